"""Peak memory of one loss forward + backward through an lm_head, standard vs fused (hf_zero.train.fused_ce), on CPU.

    python benchmarks/fused_ce_memory.py standard|fused [--tokens 2048 --vocab 32768 --hidden 256 --dtype fp32]

Run once per mode, each in a fresh process: the peak resident set above what the inputs already hold is what the
loss itself needed. Prints one JSON line. torch's CPU allocator hands tensors this large straight to mmap,
so resident memory follows the live tensors.
"""

import argparse
import json


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, from /proc/self/status. Not
    ru_maxrss: Linux carries that over from the parent across exec, so under pytest it starts at the parent's size."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["standard", "fused"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = parser.parse_args()

    import torch

    from hf_zero.train.fused_ce import linear_cross_entropy

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    targets[::7] = -100

    def step():
        if a.mode == "standard":  # transformers' ForCausalLMLoss after the lm_head
            logits = torch.nn.functional.linear(hidden, weight)
            loss = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)
        else:
            loss = linear_cross_entropy(hidden, weight, None, targets, (targets != -100).sum())
        loss.backward()
        return loss.detach()

    _reset_peak()
    base = _status_bytes("VmRSS")
    loss = step()
    peak = _status_bytes("VmHWM") - base
    print(json.dumps({"mode": a.mode, "dtype": a.dtype, "tokens": a.tokens, "vocab": a.vocab, "hidden": a.hidden,
                      "loss": loss.item(), "peak_bytes": peak,
                      "logits_bytes": a.tokens * a.vocab * hidden.element_size(),
                      "weight_grad_bytes": weight.numel() * weight.element_size()}))


if __name__ == "__main__":
    main()
