"""What only a GPU can settle about the CUDA paths (about a minute; benchmarks/gpu.sh runs it first).

1. Which fused SDPA kernels take grouped-query attention (8 query heads, 2 KV heads) with and without a mask,
   in bf16 and fp32. PyTorch's documentation says only flash attention (no mask, no fp32) and the math kernel
   take enable_gqa on CUDA; gpt.py therefore expands the KV heads on CUDA when a mask is present or the dtype
   is fp32. If a fused kernel takes those cases too, that expansion can go.
2. Our attention, as training runs it (a packed SFT row's block-diagonal mask, bf16), with the math kernel
   forbidden: it must run on a fused kernel.
3. Fused AdamW skips the update when `optimizer.found_inf` is set (the loop's sync-free non-finite guard).

    .venv/bin/python benchmarks/gpu_checks.py
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def kernels_taking_gqa(device, dtype, masked: bool) -> list[str]:
    B, H, Hkv, T, hd = 4, 8, 2, 512, 64
    q = torch.randn(B, H, T, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, hd, device=device, dtype=dtype, requires_grad=True)
    mask = torch.ones(T, T, device=device, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T) if masked else None
    ok = []
    for backend in FUSED:
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                               enable_gqa=True).sum().backward()
            ok.append(backend.name)
        except RuntimeError:
            pass
    return ok


def our_packed_attention_is_fused(device) -> bool:
    from nanoforge.core.config import ModelConfig
    from nanoforge.model.gpt import GPT
    model = GPT(ModelConfig()).to(device)  # the mini shape: 8 heads, 2 KV heads
    T = 512
    ids = torch.randint(0, 6400, (4, T), device=device)
    segments = (torch.arange(T, device=device) >= 300).long().expand(4, T)  # two conversations per row
    try:
        with sdpa_kernel(list(FUSED)), torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids, segment_ids=segments).float().sum().backward()
        return True
    except RuntimeError as e:
        print(f"   {str(e).splitlines()[0]}")
        return False


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device; nothing to check")
        return 0
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
    for dtype in (torch.bfloat16, torch.float32):
        for masked in (False, True):
            got = kernels_taking_gqa(device, dtype, masked)
            print(f"1. GQA {str(dtype).split('.')[1]:8s} mask={masked!s:5s}: {', '.join(got) or 'none (math only)'}")
    fused = our_packed_attention_is_fused(device)
    print(f"2. packed SFT attention (bf16, block-diagonal mask) on a fused kernel: {fused}")
    p = torch.nn.Parameter(torch.ones(10, device=device))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones_like(p)
    opt.found_inf = torch.ones((), device=device)
    opt.step()
    skipped = bool((p == 1).all())
    opt.found_inf = torch.zeros((), device=device)
    opt.step()
    updated = bool((p != 1).all())
    print(f"3. fused AdamW: found_inf=1 skips the update: {skipped}; found_inf=0 updates: {updated}")
    return 0 if fused and skipped and updated else 1


if __name__ == "__main__":
    sys.exit(main())
