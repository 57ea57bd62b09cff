"""The table `hf-zero estimate` prints: the run in one line, its batch, a row per strategy (model states, resident
states, activations, buffers, peak, host and NVMe bytes, whether it fits), the recommended launch, and the
sequence-parallel rows per stage."""

from __future__ import annotations

import sys

from hf_zero.core.files import human_bytes
from hf_zero.plan.profiles import load_profile

__all__ = ["print_table", "print_sequence_parallel", "ZERO3_SP_SIZE"]

ZERO3_SP_SIZE = 2  # accelerate_configs/zero3_sp.yaml's parallelism_config_sp_size (a test keeps them equal)


def _human(b) -> str:
    return human_bytes(b, digits=2)


def print_sequence_parallel(sp: dict, gpn: int, precision: str) -> None:
    """Each stage's ZeRO-3 peak per GPU without and with Ulysses at every size, and the size that fits the longest
    stage with the command that runs it."""
    sizes = [1, *sp["sizes"]]
    fitted = sp["fitted"]  # --gpu-memory given: which size fits each stage
    head = ["stage", "tokens", *(f"sp {s}" for s in sizes), *(["fits"] if fitted else [])]
    rows = [[str(r["stage"]), f"{r['seq_len']}" + (f" x{n}" if (n := r["sequences_per_row"]) > 1 else ""),
             *(_human(r["peak_bytes"][s]) for s in sizes),
             *([{None: "none", 0: "without SP"}.get(r["fits_at_sp"], f"sp {r['fits_at_sp']}")] if fitted else [])]
            for r in sp["stages"]]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print("\nsequence parallelism (Ulysses, profile zero3_sp): ZeRO-3 peak/GPU per stage, each sequence split over "
          "sp ranks (its activations / sp; the model states sharded over every rank; x2: a dpo stage's chosen and "
          "rejected sequences)")
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if not fitted:
        return
    best, stage = sp["recommended_sp_size"], sp["longest_stage"]
    if best == 0:
        print(f"longest stage {stage}: fits without sequence parallelism")
    elif best is None:
        print(f"longest stage {stage}: no sp_size fits; use more GPUs, gradient checkpointing or a shorter "
              "max_seq_length")
    else:
        # the rows' precision, where the shipped profile's differs (it trains in fp32 on a CPU)
        flags = f"--nproc {gpn}" + (f" --precision {precision}" if load_profile("zero3_sp").precision != precision
                                    else "") + f" --config {sp['config']}"
        how = (f"hf-zero train --profile zero3_sp {flags}" if best == ZERO3_SP_SIZE
               else f"zero3_sp{best}.yaml, a copy of accelerate_configs/zero3_sp.yaml with "
               f"parallelism_config_sp_size: {best}, then hf-zero train --profile zero3_sp{best}.yaml {flags}")
        print(f"recommended for the longest stage {stage}: sp_size {best}, the smallest that fits: {how}")


def print_table(summary, inputs, convention, estimates, rec, multimodal=()) -> None:
    """The model line, the batch line (as check and train print it), each dpo stage's and the multimodal model's
    lines, one row per strategy and, with --gpu-memory, the recommended launch."""
    out = sys.stdout
    lora = inputs["lora"]
    trainable = (f", trainable {summary['trainable_params']:,} (LoRA r={lora['r']})" if lora else "")
    seq = (f"{inputs['seq_len']} tokens (stage {inputs['longest_stage']}, the "
           f"{'longest' if inputs['sequences_per_row'] == 1 else 'most tokens a row: chosen + rejected'}"
           f"{'; packed rows' if inputs['packing'] else '; rows padded to the longest in a batch, at most this'})"
           if inputs["longest_stage"] else f"{inputs['seq_len']} tokens")
    print(f"model {summary['name']}: {summary['params']:,} params{trainable}, largest layer "
          f"{summary['largest_layer_params']:,}; {inputs['precision']}, {inputs['nodes']} node(s) x "
          f"{inputs['gpus_per_node']} {inputs['device']}(s), micro-batch {inputs['micro_batch']} x {seq}, "
          "accumulation "
          f"{inputs['gradient_accumulation']}, {inputs['attn_implementation']} attention"
          f"{', gradient checkpointing' if inputs['gradient_checkpointing'] else ''}"
          f"{f', each sequence split over {sp} ranks (Ulysses)' if (sp := inputs['sp_size']) > 1 else ''}"
          f"; convention {convention}",
          file=out)
    print(f"batch: {inputs['batch']} | precision: {inputs['precision']}", file=out)  # as check and train show them
    for p in inputs["preference"]:  # indented under the batch line
        print(f"  stage {p['stage']} (dpo, {p['loss_type']}): 2 sequences per row (chosen + rejected) with full "
              f"logits{', the peak counted so' if p['stage'] == inputs['longest_stage'] else ''}; "
              + ("reference-free: no reference log-probs" if p["reference_rows"] is None and p["loss_type"] == "simpo"
                 else f"reference log-probs cached on disk: {_human(p['cache_bytes'])} for {p['reference_rows']:,} "
                 f"rows ({p['cache']}), no reference model in memory" if p["reference_rows"] is not None
                 else "reference log-probs cached on disk (8 bytes a row; its data is not readable here), no "
                 "reference model in memory"), file=out)
    for line in multimodal:
        print(line, file=out)
    peak = "peak/GPU" if inputs["device"] == "GPU" else "peak/rank"
    head = ("strategy", "params", "grads", "optimizer", "states@step", "states@fwd", "activations", "buffers",
            peak, "at", "CPU/node", "NVMe", "fits")
    rows = []
    for e in estimates:
        g = e["gpu_bytes_per_rank"]
        cells = [g[k] for k in ("params", "grads", "optimizer", "model_states", "resident", "activations", "buffers",
                                "total")]
        if e["name"].startswith("fsdp"):  # FSDP2 has resharded every layer by its optimizer step
            cells[3] -= g["gathered"]
        name = e["name"] + (" 4-bit" if e.get("frozen_base") == "nf4" else "")
        rows.append([name, *map(_human, cells), e["peak"], _human(e["cpu_bytes_per_node"]),
                     _human(e["nvme_bytes"]) if e["nvme_bytes"] else "-",
                     {None: "-", True: "yes", False: "no"}[e["fits"]]])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) if i in (0, 9) else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))), file=out)
    measured = ("what torch.cuda.max_memory_allocated reports" if peak == "peak/GPU"
                else "the tensors each rank's process holds on the CPU, beside the Python and library memory")
    print(f"{peak} = the larger of states@step (+ buffers) and states@fwd + activations (+ buffers): {measured}; "
          "activations include the loss's fp32 logits work and autocast's 16-bit weight copies (see "
          "hf_zero/estimate/activations.py)"
          + (f"; fits: {peak} within 90% of --gpu-memory" if inputs["gpu_memory_bytes"] else ""), file=out)
    if rec is None:
        return
    if not rec["profile"]:
        print(f"recommended: none ({rec['reason']})", file=out)
        return
    print(f"recommended: profile {rec['profile']}, --nproc {rec['nproc']}, micro-batch {rec['micro_batch']} x "
          f"accumulation {rec['accumulation']} (global batch {rec['global_batch']}): {rec['reason']}; the largest "
          f"micro-batch that fits is {rec['largest_micro_batch']}", file=out)
    if rec["command"]:
        print(f"  {rec['command']}", file=out)
