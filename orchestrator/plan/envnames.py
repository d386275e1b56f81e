"""Who reads an environment variable a manifest or a host sets for a vLLM service.

vLLM's own names the host's vLLM answers for (host/remote/argcheck.py: its envs.py table and every
name its source quotes). The rest is read, if at all, by the libraries vLLM runs on; this table
says which by prefix, so a name nothing reads (a leftover from another engine's recipe, such as
SAFETENSORS_FAST_GPU, which no vLLM 0.33 file mentions) is shown as a warning instead of silently
doing nothing. Pure data.
"""

from __future__ import annotations

# prefix -> the consumer. Ordered: the first match names it.
CONSUMERS: tuple[tuple[str, str], ...] = (
    ("NCCL_", "NCCL"),
    ("CUDA_", "CUDA"),
    ("CUBLAS", "cuBLAS"),
    ("CUDNN_", "cuDNN"),
    ("NVIDIA_", "the NVIDIA driver/container runtime"),
    ("TORCHINDUCTOR_", "torch.compile (inductor)"),
    ("TORCHDYNAMO_", "torch.compile (dynamo)"),
    ("TORCH_", "PyTorch"),
    ("PYTORCH_", "PyTorch"),
    ("HF_", "Hugging Face hub/transformers"),
    ("HUGGINGFACE_", "Hugging Face hub"),
    ("TRANSFORMERS_", "transformers"),
    ("TOKENIZERS_", "Hugging Face tokenizers"),
    ("FLASHINFER_", "FlashInfer"),
    ("TRITON_", "Triton"),
    ("OMP_", "OpenMP"),
    ("MKL_", "MKL"),
    ("PYTHON", "Python"),
    ("LD_", "the dynamic loader"),
    ("MALLOC_", "glibc malloc"),
    ("XDG_", "XDG base directories (caches)"),
)
PLAIN = {"PATH", "HOME", "TMPDIR", "TZ", "LANG", "LC_ALL", "USER"}


def consumer_of(name: str) -> str | None:
    """The software that reads `name` (besides vLLM), or None when none we know of does."""
    if name in PLAIN:
        return "the system"
    return next((who for prefix, who in CONSUMERS if name.startswith(prefix)), None)
