//! GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) decode.
