"""Words about the machine failing the training: GPU memory at its limit, a GPU lost, Xid errors,
CUDA and host out-of-memory, NCCL timeouts, host memory low and a disk almost full; with the advice
on what to change that those mails carry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.notify.mails import Mail

GIB = 1024**3

GPU_MEMORY_ADVICE = """\
What to change (most effect first):
- lower per_device_train_batch_size (e.g. halve it) and raise gradient_accumulation_steps
  by the same factor, which keeps the effective batch size;
- shorten the sequence length (max_seq_length / max_length / sequence_len), or pack shorter samples;
- enable gradient checkpointing (gradient_checkpointing=True; Unsloth: use_gradient_checkpointing="unsloth");
- use an 8-bit optimizer (optim="adamw_bnb_8bit" or "paged_adamw_8bit"), or load the model in
  4-bit (QLoRA) / bf16 instead of fp32;
- if much memory is "reserved by PyTorch but unallocated", set
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation."""

HOST_MEMORY_ADVICE = """\
What to change:
- fewer data-loader workers (dataloader_num_workers) and a smaller prefetch factor;
- stream or memory-map the dataset instead of loading it whole (datasets: streaming=True,
  or keep it as Arrow on disk), and tokenise ahead of time;
- load the model with low_cpu_mem_usage=True / device_map so it is not materialised in host RAM first;
- a machine with more RAM, or swap, if the job needs it."""

NCCL_ADVICE = """\
A collective operation (all-reduce, broadcast...) waited past its timeout: one rank hung or died,
often because it ran out of memory or crashed first, or the ranks took different code paths.
Look at the first error of every rank in the log; NCCL_DEBUG=INFO and
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 make the cause visible. Raise the timeout
(ddp_timeout / init_process_group(timeout=...)) only if a slow step (e.g. saving) is expected."""


XID_MEANING = {
    13: "graphics engine exception (often an illegal memory access in a kernel)",
    31: "GPU memory page fault (often an application bug)",
    43: "GPU stopped processing (application fault)",
    45: "preemptive cleanup after an application fault",
    48: "double-bit ECC error (uncorrectable memory error)",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error (the GPU needs a reset)",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}


# --- GPUs ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuMem:
    index: int
    used_bytes: int | None
    total_bytes: int | None


def mem_limit(gpus: Sequence[GpuMem], fraction: float, samples: int, poll_interval_s: float) -> Mail:
    parts = []
    for g in gpus:
        if g.used_bytes is not None and g.total_bytes:
            parts.append(f"GPU{g.index} {g.used_bytes / GIB:.1f}/{g.total_bytes / GIB:.1f} GiB")
        else:
            parts.append(f"GPU{g.index}")
    which = ", ".join(parts)
    return Mail(f"GPU memory at its limit: {which}",
                f"{which} in use: at or above {fraction:.0%} of the GPU's memory for "
                f"{samples} samples in a row ({poll_interval_s:g}s apart). The next larger batch "
                f"or longer sequence will fail with CUDA out of memory.\n\n{GPU_MEMORY_ADVICE}")


@dataclass(frozen=True)
class GpuFault:
    index: int
    name: str | None
    uuid: str | None
    error: str


def gpu_failed(faults: Sequence[GpuFault], nvml_error: str | None = None) -> Mail:
    """GPUs that no longer answer; with no faulty GPU named, NVML as a whole stopped answering."""
    if faults:
        detail = "; ".join(f"GPU{g.index} {g.name or ''} {g.uuid or ''}: {g.error}".replace("  ", " ")
                           for g in faults)
    else:
        detail = f"NVML stopped answering after GPUs were seen: {nvml_error}"
    n = len(faults) or "the"
    return Mail(f"the machine's GPU failed: {detail}"[:150],
                f"{detail}\n\n{n} GPU(s) no longer answer the driver. Training on them has most likely "
                "crashed or hangs; a lost GPU comes back only after a reset or reboot of the machine, "
                "usually by the provider. Checkpoints already synced are safe; check `supervisorctl "
                "status` and `nvidia-smi`, and ask the provider to replace the machine if it persists.")


def xid(code: int, index: int | None, name: str | None, uuid: str | None, app_fault: bool) -> Mail:
    meaning = XID_MEANING.get(code, "see NVIDIA's Xid catalogue")
    where = f"GPU{index}" if index is not None else "a GPU"
    return Mail(f"Xid {code} on {where}: {meaning}",
                f"The NVIDIA driver reported Xid {code} on {where} {name or ''} {uuid or ''}: {meaning}.\n"
                + ("This usually comes from the program (an illegal memory access); check the training log."
                   if app_fault else
                   "This is a hardware or driver failure: the training on this GPU has probably crashed, "
                   "and the GPU may need a reset. Ask the provider to replace the machine if it recurs."))


# --- out of memory in the training -------------------------------------------------------------------

def _indent(lines: Sequence[str]) -> str:
    return "\n".join(f"    {x[:500]}" for x in lines) if lines else "    (none)"


def _log_hint(log_path: str | None) -> str:
    return f"Log: {log_path} (supervisorctl tail -n 200)" if log_path else "Log: supervisorctl tail -n 200"


def cuda_oom(line: str, context: Sequence[str], log_path: str | None, gpu: int | None = None,
             tried: str | None = None, total: str | None = None, free: str | None = None,
             reserved_unallocated: str | None = None) -> Mail:
    where = f"GPU {gpu}" if gpu is not None else "the GPU"
    facts = []
    if tried:
        facts.append(f"tried to allocate {tried}")
    if total:
        facts.append(f"{free} free of {total}")
    frag = ""
    if reserved_unallocated:
        frag = (f"\n{reserved_unallocated} was reserved by PyTorch but unallocated: "
                "fragmentation; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps.\n")
    return Mail(f"CUDA out of memory on {where}" + (f" ({', '.join(facts)})" if facts else ""),
                f"The training ran out of GPU memory on {where}.\n\nEvidence:\n    {line}\n{frag}\n"
                f"Last log lines:\n{_indent(context)}\n\n{GPU_MEMORY_ADVICE}\n\n{_log_hint(log_path)}\n")


def host_alloc(line: str, context: Sequence[str], log_path: str | None) -> Mail:
    return Mail("training ran out of host memory (RAM)",
                f"The training could not allocate host memory (RAM).\n\nEvidence:\n    {line}\n\n"
                f"Last log lines:\n{_indent(context)}\n\n{HOST_MEMORY_ADVICE}\n\n{_log_hint(log_path)}\n")


def nccl_timeout(line: str, context: Sequence[str], log_path: str | None) -> Mail:
    return Mail("NCCL collective operation timed out (a rank hung or died)",
                f"NCCL's watchdog timed out.\n\nEvidence:\n    {line}\n\n"
                f"Last log lines:\n{_indent(context)}\n\n{NCCL_ADVICE}\n\n{_log_hint(log_path)}\n")


def host_oom(evidence: Sequence[str], context: Sequence[str], log_path: str | None, *, ended: bool = False,
             exit_code: int | None = None, signal: str | None = None) -> Mail:
    """The kernel's OOM killer; `ended`: said at the end of the run, with how it ended."""
    how = ""
    if ended:
        how = f"The training ended with exit code {exit_code}" + (f" ({signal})" if signal else "") + ".\n"
    return Mail("training killed by the kernel OOM killer (host RAM exhausted)",
                f"The kernel's OOM killer killed the training (or one of its processes): the machine ran "
                f"out of host memory (RAM), not GPU memory.\n{how}\nEvidence:\n{_indent(evidence)}\n\n"
                f"Last log lines:\n{_indent(context)}\n\n{HOST_MEMORY_ADVICE}\n\n{_log_hint(log_path)}\n")


# --- the host --------------------------------------------------------------------------------------

def host_mem_low(available_bytes: int, total_bytes: int, available_pct: float, min_pct: float) -> Mail:
    subject = (f"host memory almost exhausted: {available_bytes / GIB:.1f} GiB of "
               f"{total_bytes / GIB:.1f} GiB available ({available_pct:.1f}%)")
    return Mail(subject, f"{subject}.\nBelow alerts.host_mem_min_pct = {min_pct:g}%. The kernel's OOM killer "
                         "kills the largest process next, which is usually the training.\n\n" + HOST_MEMORY_ADVICE)


