"""The register layout of the decode state tile, compiled for Hopper (SM90) on the CPU: vLLM's packed decode kernels
against laqat's decode kernel under a serving profile.

On a GPU the order in which a ``tl.sum`` adds its terms follows the operand's layout (the elements each thread holds,
added in turn, then the lanes in a butterfly), and Triton chooses that layout from the kernel's loads and stores. Two
kernels with the same operations sum the same way only if their state tiles get the same layout (docs/serving.md,
"The GPU check"). ``triton.compile`` builds the TTGIR for an SM90 target without a GPU; this module compiles each
kernel with the launch's constexprs and 16-byte aligned pointers (as a launch on tensors from torch's allocator
specializes them) and prints, as JSON, the layout of every ``tt.reduce`` over a [32 x 128] fp32 tile.

    python -m tests.serving.sm90_layouts SRC     # SRC: vLLM's kernel files extracted for a GPU (no interpreter edits)

Run without ``TRITON_INTERPRET`` (the kernels must be JIT functions); tests/serving/test_sm90_layouts.py runs it in a
subprocess.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

H, K, V, BK, BV = 16, 128, 128, 128, 32
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _jit_function(kernel):
    import triton

    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def ttgir(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3) -> str:
    """The TTGIR of ``kernel`` for SM90: ``signature`` the runtime arguments' types, ``constexprs`` the rest."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(kernel)
    full = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if full[name].startswith("*")}
    source = ASTSource(fn, signature=full, constexprs={n: v for n, v in constexprs.items() if full[n] == "constexpr"},
                       attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ttgir"]


def tile_reductions(text: str) -> list[str]:
    """The layout of every ``tt.reduce`` operand of shape [BV x BK] fp32 (``#blocked...`` resolved to its text)."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", text, flags=re.M))
    found = re.findall(rf"\}}\) : \(tensor<{BV}x{BK}xf32, (#\w+)>\)", text)
    return [layouts[name] for name in found]


def vllm_packed(src: Path, kind: str, cache: str) -> list[str]:
    """vLLM 0.33.0's packed decode kernel as its launcher runs it at 16 heads of 128 (GDN: 1 warp, 3 stages; KDA: 4
    warps, 2 stages)."""
    from tests.serving import vllm_oracle

    vllm = vllm_oracle.load(src)
    state = f"*{DTYPES[cache]}"
    if kind == "gdn":
        signature = dict(mixed_qkv="*bf16", a="*bf16", b="*bf16", A_log="*fp32", dt_bias="*fp32", o="*bf16",
                         h0=state, ht=state, ssm_state_indices="*i32", scale="fp32")
        constexprs = dict(stride_mixed_qkv_tok=3 * H * K, stride_a_tok=H, stride_b_tok=H,
                          stride_init_state_token=H * V * K, stride_final_state_token=H * V * K, stride_indices_seq=1,
                          H=H, HV=H, K=K, V=V, BK=BK, BV=BV, SOFTPLUS_THRESHOLD=20.0, USE_QK_L2NORM_IN_KERNEL=True,
                          SPLIT_BATCH_HEAD_GRID=False)
        kernel, warps, stages = vllm.gdn_recurrent.fused_recurrent_gated_delta_rule_packed_decode_kernel, 1, 3
    else:
        signature = dict(mixed_qkv="*bf16", raw_g="*bf16", raw_beta="*bf16", A_log="*fp32", dt_bias="*fp32",
                         out="*bf16", state=state, state_indices="*i32", lower_bound="fp32", scale="fp32",
                         stride_beta_token="i32", stride_state_indices="i32")
        constexprs = dict(stride_mixed_token=3 * H * K, stride_g_token=H * K, stride_state_token=H * V * K, H=H, K=K,
                          V=V, BK=BK, BV=BV, SOFTPLUS_THRESHOLD=20.0, USE_LOWER_BOUND=False, launch_pdl=False)
        kernel, warps, stages = vllm.kda_recurrent.fused_recurrent_kda_packed_decode_kernel, 4, 2
    return tile_reductions(ttgir(kernel, signature, constexprs, warps, stages))


def laqat_decode(kind: str, cache: str, state: str, io: str | None = None, as_launched: bool = True) -> list[str]:
    """laqat's decode forward kernel for the serving profile of ``kind`` and ``cache`` with the spec's state layout
    ``state``, its state tiles entering and leaving in the dtype its launcher picks (``io`` overrides it), with the
    launcher's params (``as_launched``) or the spec's own (a kv spec's states not transposed)."""
    import torch

    from la_compiler.ir.spec import RecurrenceSpec
    from la_compiler.kernels.decode import kernels, suffix
    from la_compiler.policy.resolution import Policy

    serving = {"state_dtype": cache, "forward": "laqat", **({"model": "kimi_k3"} if kind == "kda" else {})}
    resolved = Policy.from_dict({"linear_attention": [{"module_name": "*", "cfg": {"serving": serving}}]}).resolve(
        "model.layers.0.attn", kind)
    spec = RecurrenceSpec(kind, state=state, phase=resolved.phase, quant=resolved.quant, extra=resolved.extra,
                          kernel="decode_serving")
    params = (suffix.kernel_params(spec, torch.bfloat16)[0] if as_launched
              else suffix.DecodeParams.from_spec(spec, torch.bfloat16))
    tile = f"*{DTYPES[io or str(suffix.state_io_dtype(params)).removeprefix('torch.')]}"
    signature = dict(q="*fp32", k="*fp32", v="*bf16", g="*fp32", beta="*fp32", h0=tile, o="*bf16", ht=tile,
                     ckpt=tile, cu_seqlens="*i32", block_offsets="*i32", scale="fp32", window="i32")
    constexprs = dict(H=H, HV=H, K=K, V=V, BK=BK, BV=BV, CK=suffix.CHECKPOINT_EVERY, SAVE_CKPT=True,
                      **suffix._constants(params, "decode_fwd_kernel"))
    return tile_reductions(ttgir(kernels.decode_fwd_kernel, signature, constexprs, suffix._forward_warps(params)))


def main(argv=None) -> None:
    src = Path((argv or sys.argv[1:])[0])
    rows = {}
    for kind, cache in (("gdn", "bfloat16"), ("gdn", "float32"), ("kda", "bfloat16")):
        rows[f"{kind}:{cache}"] = {
            "vllm_packed": vllm_packed(src, kind, cache),
            "laqat_vk": laqat_decode(kind, cache, "vk"),
            "laqat_kv": laqat_decode(kind, cache, "kv"),
            "laqat_kv_not_transposed": laqat_decode(kind, cache, "kv", as_launched=False),
            **({"laqat_fp32_tiles": laqat_decode(kind, cache, "vk", io="float32")} if cache != "float32" else {}),
        }
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
