#!/usr/bin/env python3
"""Tiny random GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) checkpoints and
their golden outputs, made by transformers' own model classes (no re-implementation here).

For each architecture it writes `tests/fixtures/<name>/`:
  config.json, model.safetensors (bf16, like real checkpoints), tokenizer.json,
  golden.safetensors  prefill_logits [T, V] f32, decode_logits [S, V] f32,
                      prompt_ids [T] i64, generated_ids [S + 1] i64,
  golden.json         versions, dtype, seed, margins, the prompt text.

Shapes are tiny except the MLA latent widths, which are the production ones
(kv_lora_rank 512 + qk_rope_head_dim 64) so the fp8_ds_mla cache applies. index_topk (8) is
smaller than the sequence (16 prompt + 10 decode tokens), so the sparse path is exercised.

Compute dtype: the weights are stored in bf16, and the goldens are computed by transformers
in **float32** from those bf16 weights. That makes the golden the exact math of the
checkpoint: the only rounding our side adds is the kernel's own (bf16 q, bf16 / fp8 cache
rows, bf16 indexer keys), so the tolerance measures exactly that. A bf16 transformers run
would add HF's own rounding of every activation (recorded as `hf_bf16_vs_f32_max_abs`, for
scale) and make top-k near-ties more likely.

Near-ties: a top-k decision whose margin is below what our rounding can move would make the
test flaky. The generator records every top-k transformers takes (indexer token selection,
expert groups and experts, the greedy token) by wrapping `torch.topk` / `Tensor.topk` while
those modules run, and takes the first seed from --seed whose smallest margins clear the
thresholds below. The margins are written to golden.json.

Usage: python tools/make_fixtures.py [--out tests/fixtures] [--seed 0]
Needs: transformers==5.17.0, torch==2.11.0, tokenizers, safetensors (tools/requirements-fixtures.txt).
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

PROMPT_TOKENS = 16
DECODE_STEPS = 10
INDEX_TOPK = 8

# Smallest acceptable margins (see the module doc). Indexer: gap between the k-th and the
# (k+1)-th score over the largest |score| of that row. Router: absolute gap in sigmoid-score
# space (bias included). Greedy: gap between the two largest logits.
MIN_INDEX_REL_MARGIN = 2e-3
MIN_ROUTE_MARGIN = 1e-3
MIN_LOGIT_GAP = 2e-2
# A random tiny model often repeats one token greedily; ask for some variety so the greedy
# comparison means something.
MIN_DISTINCT_GENERATED = 4

CORPUS = """\
Sparse attention reads only the slots the indexer picks, and the rest of the cache is never touched.
The lightning indexer scores every earlier token with a few cheap heads and keeps the top k.
Multi-head latent attention stores one compressed latent row per token: five hundred and twelve
values of latent and sixty four values of rotary position, in bf16 or in fp8 with four scales.
A virtual block table maps logical positions to physical slots, page by page, like vLLM does.
The quick brown fox jumps over the lazy dog while the kernel walks its list of indices.
GLM-5 and DeepSeek-V3.2 share this design; they differ in head sizes, rotary layout and routing.
Mixture of experts layers route each token to a few experts chosen by sigmoid scores and a bias.
Tests compare the logits of a tiny random model with the logits that transformers computed.
""".splitlines()

PROMPT_TEXT = "The lightning indexer scores every earlier token and the kernel reads only the slots it picks."


# The fixtures' chat template (mla-serve's /v1/chat/completions, mla-run --chat): GLM-style role
# markers as plain text, since the tiny tokenizer's only special token is <|endoftext|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}"
    "<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer_config(out_dir: str) -> None:
    cfg = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def make_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def glm_config(vocab: int, eos: int) -> GlmMoeDsaConfig:
    # qk_nope 48 != v_head 64 (GLM-5: 192 / 256) so W_UK / W_UV mix-ups show; 4 layers,
    # layer 0 dense, layers 1-3 MoE; indexer "full", "shared", "full", "shared".
    return GlmMoeDsaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=512,
        q_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=48,
        v_head_dim=64,
        index_topk=INDEX_TOPK,
        index_head_dim=128,
        index_n_heads=8,
        first_k_dense_replace=1,
        indexer_types=["full", "shared", "full", "shared"],
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        initializer_range=0.06,
        bos_token_id=None,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )


def deepseek_config(vocab: int, eos: int) -> DeepseekV32Config:
    # qk_nope 32 != v_head 16; n_group 4 / topk_group 2 exercise group-limited routing;
    # 2 shared experts (intermediate = moe_intermediate × n_shared); YaRN as in V3.2.
    return DeepseekV32Config(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=128,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=512,
        q_lora_rank=48,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=16,
        index_topk=INDEX_TOPK,
        index_head_dim=128,
        index_n_heads=8,
        first_k_dense_replace=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        initializer_range=0.06,
        bos_token_id=None,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )


ARCHS = {
    "glm_moe_dsa-tiny": (glm_config, GlmMoeDsaForCausalLM),
    "deepseek_v32-tiny": (deepseek_config, DeepseekV32ForCausalLM),
}


def perturb_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random init leaves norm weights at 1, biases and the routing bias at 0: a forward that
    forgot to apply them would still match. Give them values that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight") or "k_norm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "k_norm.bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn(b.shape, generator=gen))


class TopkRecorder:
    """Records the inputs of the top-k calls transformers makes inside the indexer and the
    router, by wrapping `Tensor.topk` / `torch.topk` while those modules run."""

    def __init__(self):
        self.where = None
        self.index_rows = []  # (scores row, k)
        self.route_rows = []  # (scores row, k)
        self.selected = {}  # layer -> one sorted list of selected causal positions per query token
        self.routed = {}  # layer -> one sorted list of chosen experts per token
        self.layer = None
        # (kind, layer) -> {token: smallest margin of that token's top-k calls}; indexer margins
        # relative to the row's largest |score|, router margins absolute (see min_margin).
        self.decision = {}
        self._tensor_topk = torch.Tensor.topk
        self._topk = torch.topk

    def _record(self, x, k):
        rows = x.detach().float().reshape(-1, x.shape[-1])
        target = self.index_rows if self.where == "indexer" else self.route_rows
        done = self.selected if self.where == "indexer" else self.routed
        start = len(done.get(self.layer, []))
        per_token = self.decision.setdefault((self.where, self.layer), {})
        for i, r in enumerate(rows):
            target.append((r.clone(), int(k)))
            m = self.min_margin([(r, int(k))], relative=self.where == "indexer")
            t = start + i
            per_token[t] = min(per_token.get(t, math.inf), m)

    def install(self, model):
        rec = self

        def tensor_topk(self_, k, *a, **kw):
            if rec.where == "indexer":
                rec._record(self_, k)
            return rec._tensor_topk(self_, k, *a, **kw)

        def topk(x, k=None, *a, **kw):
            if rec.where == "router":
                rec._record(x, k)
            return rec._topk(x, k, *a, **kw)

        torch.Tensor.topk = tensor_topk
        torch.topk = topk
        for name, m in model.named_modules():
            kind = "indexer" if name.endswith("self_attn.indexer") else "router" if name.endswith("mlp.gate") else None
            if kind is None:
                continue
            layer = int(name.split(".")[2])
            def enter(_m, _a, kind=kind, layer=layer):
                rec.where, rec.layer = kind, layer  # returns None: the arguments stay as they are

            m.register_forward_pre_hook(enter)
            m.register_forward_hook(lambda _m, _a, _o: setattr(rec, "where", None))
            if kind == "indexer":
                m.register_forward_hook(lambda _m, a, o, layer=layer: rec._selected(layer, a, o))
            else:
                # The router returns (logits, weights, expert ids [tokens, top_k]).
                m.register_forward_hook(
                    lambda _m, a, o, layer=layer: self.routed.setdefault(layer, []).extend(
                        sorted(r) for r in o[2].tolist()
                    )
                )

    def _selected(self, layer, args, out):
        # out [1, S, k] positions; rows of a prefill hold masked (non-causal) picks too: drop them.
        start = len(self.selected.setdefault(layer, []))
        for i, row in enumerate(out[0].tolist()):
            self.selected[layer].append(sorted(p for p in row if p <= start + i))

    def uninstall(self):
        torch.Tensor.topk = self._tensor_topk
        torch.topk = self._topk

    @staticmethod
    def min_margin(rows, relative):
        best = math.inf
        for r, k in rows:
            v = r[r > -1e30]  # masked (non-causal / other-group) entries are -inf or dtype-min
            if v.numel() <= k:
                continue  # everything is selected: no decision taken
            s = torch.sort(v, descending=True).values
            gap = float(s[k - 1] - s[k])
            if relative:
                gap /= max(float(v.abs().max()), 1e-30)
            best = min(best, gap)
        return best


def greedy_run(model, prompt_ids):
    """Prefill the prompt, then DECODE_STEPS greedy steps through the KV cache."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        prefill = out.logits[0].float()
        past = out.past_key_values
        generated = [int(prefill[-1].argmax())]
        decode = []
        for _ in range(DECODE_STEPS):
            step = torch.tensor([[generated[-1]]], dtype=torch.long)
            out = model(input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            decode.append(logits)
            generated.append(int(logits.argmax()))
    return prefill, torch.stack(decode), generated


def logit_gap(prefill, decode):
    rows = [prefill[-1]] + list(decode)
    gaps = [float(torch.topk(r, 2).values[0] - torch.topk(r, 2).values[1]) for r in rows]
    return min(gaps)


def build(name, seed, tok, out_dir):
    make_config, cls = ARCHS[name]
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    prompt_ids = tok.encode(PROMPT_TEXT).ids[:PROMPT_TOKENS]
    assert len(prompt_ids) == PROMPT_TOKENS, "prompt text too short for PROMPT_TOKENS"

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = cls(make_config(vocab, eos))
    perturb_norms(model, gen)
    model = model.to(torch.bfloat16)

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        # Goldens come from the saved checkpoint as transformers loads it, in float32.
        hf = cls.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        saved = load_file(os.path.join(tmp, "model.safetensors"))
        for k, v in hf.state_dict().items():
            if k in saved:
                assert torch.equal(saved[k].float(), v.float()), f"round trip changed {k}"
        rec = TopkRecorder()
        rec.install(hf)
        try:
            prefill, decode, generated = greedy_run(hf, prompt_ids)
        finally:
            rec.uninstall()
        index_margin = rec.min_margin(rec.index_rows, relative=True)
        route_margin = rec.min_margin(rec.route_rows, relative=False)
        gap = logit_gap(prefill, decode)

        hf16 = cls.from_pretrained(tmp, dtype=torch.bfloat16, attn_implementation="eager").eval()
        p16, d16, g16 = greedy_run(hf16, prompt_ids)
        bf16_drift = max(float((p16 - prefill).abs().max()), float((d16[: len(decode)] - decode).abs().max()))

        margins = {
            "indexer_min_relative_margin": index_margin,
            "router_min_margin": route_margin,
            "greedy_min_logit_gap": gap,
            "indexer_topk_calls": len(rec.index_rows),
            "router_topk_calls": len(rec.route_rows),
            "distinct_generated": len(set(generated)),
        }
        ok = (
            index_margin >= MIN_INDEX_REL_MARGIN
            and route_margin >= MIN_ROUTE_MARGIN
            and gap >= MIN_LOGIT_GAP
            and len(set(generated)) >= MIN_DISTINCT_GENERATED
        )
        if out_dir is None or not ok:
            return ok, margins

        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(os.path.join(tmp, "config.json"), out_dir)
        shutil.copy(os.path.join(tmp, "model.safetensors"), out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    write_tokenizer_config(out_dir)
    save_file(
        {
            "prompt_ids": torch.tensor(prompt_ids, dtype=torch.int64),
            "prefill_logits": prefill.contiguous(),
            "decode_logits": decode.contiguous(),
            "generated_ids": torch.tensor(generated, dtype=torch.int64),
        },
        os.path.join(out_dir, "golden.safetensors"),
    )
    meta = {
        "model_type": hf.config.model_type,
        "class": cls.__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "weights_dtype": "bfloat16",
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "seed": seed,
        "prompt_text": tok.decode(prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "decode_steps": DECODE_STEPS,
        "index_topk": hf.config.index_topk,
        "generated_ids": generated,
        "margins": margins,
        "margin_thresholds": {
            "indexer_min_relative_margin": MIN_INDEX_REL_MARGIN,
            "router_min_margin": MIN_ROUTE_MARGIN,
            "greedy_min_logit_gap": MIN_LOGIT_GAP,
            "distinct_generated": MIN_DISTINCT_GENERATED,
        },
        # Per layer, per token: the smallest margin of the top-k decisions taken for it (null:
        # every candidate was selected, no decision). Tests use them to tell a near-tie that
        # rounding may flip from a real disagreement.
        "decision_margins": {
            kind: {
                str(layer): [
                    None if not math.isfinite(per.get(t, math.inf)) else per[t]
                    for t in range(PROMPT_TOKENS + DECODE_STEPS)
                ]
                for (k2, layer), per in sorted(rec.decision.items(), key=lambda kv: (kv[0][0], kv[0][1]))
                if k2 == kind
            }
            for kind in ("indexer", "router")
        },
        "greedy_logit_gaps": [
            float(torch.topk(r, 2).values[0] - torch.topk(r, 2).values[1]) for r in [prefill[-1]] + list(decode)
        ],
        "indexer_selected": {str(k): v for k, v in sorted(rec.selected.items())},
        "experts_routed": {str(k): v for k, v in sorted(rec.routed.items())},
        "hf_bf16_vs_f32_max_abs": bf16_drift,
        "hf_bf16_greedy_ids": g16,
        "logit_abs_max": float(max(prefill.abs().max(), decode.abs().max())),
    }
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return ok, margins


def rope_cases():
    """transformers' RoPE tables and softmax scales for a few rope configs, to check our
    reading of config.json against (tests/fixtures/rope_cases.json)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention,
        DeepseekV32RotaryEmbedding,
    )
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention, GlmMoeDsaRotaryEmbedding

    base = dict(
        vocab_size=32, hidden_size=32, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=512, q_lora_rank=16, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=8, index_head_dim=128, index_n_heads=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
        max_position_embeddings=163840,
    )
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cases = [
        ("deepseek_v32", "legacy rope_scaling + rope_theta, V3.2 YaRN", dict(rope_theta=10000.0, rope_scaling=yarn)),
        ("deepseek_v32", "YaRN, mscale != mscale_all_dim",
         dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                               "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0})),
        ("deepseek_v32", "YaRN, no mscale keys, truncate false, beta_fast 16",
         dict(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                               "original_max_position_embeddings": 2048, "beta_fast": 16, "truncate": False})),
        ("glm_moe_dsa", "default, theta 1e6", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    ]
    out = []
    for model_type, what, kw in cases:
        cfg_json = {"model_type": model_type, **base, **kw}
        if model_type == "deepseek_v32":
            cfg, rot_cls, attn_cls = DeepseekV32Config(**base, **kw), DeepseekV32RotaryEmbedding, DeepseekV32Attention
        else:
            cfg, rot_cls, attn_cls = GlmMoeDsaConfig(**base, **kw), GlmMoeDsaRotaryEmbedding, GlmMoeDsaAttention
        rot = rot_cls(cfg)
        out.append({
            "what": what,
            "config": cfg_json,
            "inv_freq": [float(x) for x in rot.inv_freq],
            "attention_factor": float(rot.attention_scaling),
            "softmax_scale": float(attn_cls(cfg, 0).scaling),
        })
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__, "cases": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--seed", type=int, default=0, help="first seed tried")
    ap.add_argument("--tries", type=int, default=400)
    ap.add_argument("--only", choices=sorted(ARCHS), help="make one fixture")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rope_cases.json"), "w") as f:
        json.dump(rope_cases(), f, indent=1)
        f.write("\n")

    tok = make_tokenizer(384)
    for name in sorted(ARCHS):
        if args.only and name != args.only:
            continue
        for seed in range(args.seed, args.seed + args.tries):
            ok, margins = build(name, seed, tok, None)
            print(f"{name} seed {seed}: {'ok' if ok else 'near-tie'} {margins}", file=sys.stderr)
            if ok:
                out_dir = os.path.join(args.out, name)
                build(name, seed, tok, out_dir)
                print(f"wrote {os.path.normpath(out_dir)}", file=sys.stderr)
                break
        else:
            sys.exit(f"{name}: no seed in {args.seed}..{args.seed + args.tries} clears the margins")


if __name__ == "__main__":
    main()
