//! Writes a block-scaled FP8 copy of a checkpoint, as DeepSeek-V3.2 and GLM-5-FP8 ship:
//! every linear weight (`*_proj.weight`, the MLA, indexer and expert projections; not the
//! embedding, lm_head, router or norms) becomes `F8_E4M3` with an f32 `weight_scale_inv` per
//! 128 × 128 block, and config.json gains the `quantization_config` that says so.
//!
//! The scales are powers of two (amax / 448 rounded up, UE8M0-style), so that `e4m3 × scale`
//! is exact in f32 and a dequantised f32 copy is the very same model (tests/model_fp8_weights.rs).
//!
//!   cargo run --release --example quantize_fp8 -- SRC_DIR DST_DIR
//!
//! Made the checked-in `tests/fixtures/*-fp8` checkpoints from the bf16 ones.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use sparse_mla::model::weights::write_checkpoint;
use sparse_mla::reference::numerics::{f32_to_e4m3, E4M3_MAX};

const BLOCK: [usize; 2] = [128, 128];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, dst] = args.as_slice() else {
        return Err("usage: quantize_fp8 SRC_DIR DST_DIR".into());
    };
    let (src, dst) = (Path::new(src), Path::new(dst));
    let bytes = std::fs::read(src.join("model.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    let mut out = Vec::new();
    let mut quantized = 0;
    for name in &names {
        let name = name.as_str();
        let t = st.tensor(name)?;
        let shape = t.shape().to_vec();
        let linear =
            shape.len() == 2 && name.ends_with("_proj.weight") && !name.contains("weights_proj");
        if !linear {
            out.push((name.to_string(), t.dtype(), shape, t.data().to_vec()));
            continue;
        }
        if t.dtype() != Dtype::BF16 {
            return Err(format!("{name}: expected a bf16 weight, found {:?}", t.dtype()).into());
        }
        let w: Vec<f32> = t
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let (q, s) = quantize_pow2(&w, [shape[0], shape[1]]);
        let scale_shape = vec![shape[0].div_ceil(BLOCK[0]), shape[1].div_ceil(BLOCK[1])];
        out.push((
            format!("{name}_scale_inv"),
            Dtype::F32,
            scale_shape,
            s.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        out.push((name.to_string(), Dtype::F8_E4M3, shape, q));
        quantized += 1;
    }
    write_checkpoint(dst, &out, 1)?;
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    config["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK
    });
    std::fs::write(
        dst.join("config.json"),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    if src.join("tokenizer.json").is_file() {
        std::fs::copy(src.join("tokenizer.json"), dst.join("tokenizer.json"))?;
    }
    eprintln!(
        "{quantized} weights quantised to FP8 into {}",
        dst.display()
    );
    Ok(())
}

/// Block-scaled e4m3 with power-of-two scales: per block `scale = 2^ceil(log2(amax / 448))`
/// (1 for an all-zero block), `q = e4m3(w / scale)` (the division is exact).
fn quantize_pow2(w: &[f32], [rows, cols]: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    let (sr, sc) = (rows.div_ceil(BLOCK[0]), cols.div_ceil(BLOCK[1]));
    let mut scales = vec![1.0f32; sr * sc];
    for (bi, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((bi / sc) * BLOCK[0], (bi % sc) * BLOCK[1]);
        let mut amax = 0.0f32;
        for i in r0..(r0 + BLOCK[0]).min(rows) {
            for j in c0..(c0 + BLOCK[1]).min(cols) {
                amax = amax.max(w[i * cols + j].abs());
            }
        }
        if amax > 0.0 {
            *s = (amax / E4M3_MAX).log2().ceil().exp2();
        }
    }
    let q = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            f32_to_e4m3(w[k] / scales[(i / BLOCK[0]) * sc + j / BLOCK[1]])
        })
        .collect();
    (q, scales)
}
