"""Small shared helpers for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import pbs
from pbs.layout import Layout


def random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=16, seq_len_q=None, seed=0, dtype=torch.float32):
    """Plain Gaussian q, k, v (shapes as in pbs.attention)."""
    gen = torch.Generator().manual_seed(seed)
    nq = seq_len if seq_len_q is None else seq_len_q
    q = torch.randn(batch, heads_q, nq, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, seq_len, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, seq_len, head_dim, generator=gen).to(dtype)
    return q, k, v


def small_config(**overrides) -> pbs.PBSConfig:
    """Block 32 / segment 64 so that small sequences have several segments."""
    base = dict(block_size=32, segment_size=64)
    base.update(overrides)
    return pbs.PBSConfig(**base)


def layout_of(q, k, config) -> Layout:
    from pbs.planning import make_layout

    return make_layout(q, k, config)


def attention_in_dtype(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    mask=None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Masked softmax attention computed wholly in ``dtype``: logits, softmax and ``P @ V``.

    In float64 it is the truth the kernel tests measure against; in the test's dtype it is
    PyTorch's own result at that dtype (flash-attention's ``attention_ref(upcast=False)``).

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hk, Nk, D)``; v: ``(B, Hk, Nk, Dv)``, ``Hq % Hk == 0``.
        mask: a `BlockMask` of the selected key blocks, or None for every key.
        query_positions: ``(B, Hq, Nq)`` original positions, None: ``Nk - Nq + t``.
        key_positions: ``(B, Hk, Nk)`` original positions, None: ``t``.
        causal: drop keys whose position is after the query's.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``dtype``; a query that sees no key gets 0.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    group = hq // hk
    device = q.device
    scale = d**-0.5 if scale is None else scale
    if query_positions is None:
        query_positions = torch.arange(nk - nq, nk, device=device).expand(b, hq, nq)
    if key_positions is None:
        key_positions = torch.arange(nk, device=device).expand(b, hk, nk)
    qpos = query_positions.expand(b, hq, nq).reshape(b, hk, group, nq, 1)
    kpos = key_positions.expand(b, hk, nk).reshape(b, hk, 1, 1, nk)
    q_, k_, v_ = q.to(dtype).reshape(b, hk, group, nq, d), k.to(dtype), v.to(dtype)
    blocks = None if mask is None else mask.to_dense().reshape(b, hk, group, -1, mask.layout.num_key_blocks)
    out = torch.empty(b, hk, group, nq, v.shape[-1], dtype=dtype, device=device)
    # Query rows per step: 32M scores (256 MiB of float64 logits), on the GPU too: the 64K-token
    # tests reached tests/conftest.py's memory cap with 1 GiB steps (their inputs and float64 copies
    # hold the rest).
    rows = max(1, (1 << 25) // max(1, b * hq * nk))
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        logits = torch.einsum("bhgmd,bhnd->bhgmn", q_[:, :, :, r0:r1], k_).mul_(scale)
        keep = None
        if blocks is not None:
            bs = mask.layout.block_size
            row_blocks = blocks[:, :, :, torch.arange(r0, r1, device=device) // bs]
            keep = row_blocks.repeat_interleave(bs, -1)[..., :nk]
        if causal:
            visible = kpos <= qpos[:, :, :, r0:r1]
            keep = visible if keep is None else keep & visible
        if keep is not None:
            logits.masked_fill_(~keep, float("-inf"))
        probs = logits.softmax(-1).nan_to_num_(0.0)
        out[:, :, :, r0:r1] = torch.einsum("bhgmn,bhnd->bhgmd", probs, v_)
    return out.reshape(b, hq, nq, -1)


def assert_max_abs_error_within_torch(
    actual: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    factor: float = 2.0,
    floor: float = 1e-5,
) -> tuple[float, float]:
    """Flash-attention's rule on the worst element: ``max|actual - truth| <= factor * max|torch -
    truth| + floor``, with the truth computed in float64 and ``torch`` PyTorch's own matmul-softmax
    in ``actual``'s dtype, both from the inputs ``q, k, v`` the kernel was given (arguments as in
    `attention_in_dtype`).

    The relative Frobenius check (`pbs.testing.assert_close_to_reference`) averages a few bad
    elements away (an unmasked padded key, one wrong row); this one does not.

    Returns:
        ``(kernel max-abs error, torch's max-abs error)``.
    """
    args = dict(mask=mask, query_positions=query_positions, key_positions=key_positions, causal=causal, scale=scale)
    truth = attention_in_dtype(q, k, v, torch.float64, **args)
    at_dtype = attention_in_dtype(q, k, v, actual.dtype, **args)
    err = float((actual.double() - truth).abs().max())
    torch_err = float((at_dtype.double() - truth).abs().max())
    bound = factor * torch_err + floor
    if not err <= bound:  # also catches NaN
        raise AssertionError(
            f"max-abs error {err:.3e} exceeds {factor} x torch's {torch_err:.3e} at {actual.dtype} + {floor:g} = {bound:.3e}"
        )
    return err, torch_err


def assert_plan_output_within_torch(out: torch.Tensor, plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """`assert_max_abs_error_within_torch` for the output of ``pbs.attention(q, k, v, ...)`` (in the
    original query order) and the `Plan` it ran: truth and torch's result use the plan's mask and
    permutations, on the same ``q, k, v`` (in ``out``'s dtype)."""
    q, k, v = (x.to(out.dtype) for x in (q, k, v))
    perm_q, perm_k = plan.query_permutation, plan.key_permutation
    return assert_max_abs_error_within_torch(
        perm_q.apply(out), perm_q.apply(q), perm_k.apply(k), perm_k.apply(v), plan.mask,
        plan.query_positions(), plan.key_positions(), plan.layout.causal, **kwargs,
    )


def tiny_model_config(kind: str = "llama", **overrides):
    """A 2-layer random ``transformers`` config (GQA 4:2, hidden 64): ``"llama"`` or ``"qwen2"``.
    Shared by the integration and tensor-parallel tests; transformers is imported only here."""
    import transformers

    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    fields.update(overrides)
    return transformers.LlamaConfig(**fields) if kind == "llama" else transformers.Qwen2Config(**fields)


def save_tiny_model_and_tokenizer(path: Path, kind: str = "llama") -> None:
    """Saves a random `tiny_model_config` model (seed 0) and a word-level tokenizer of its 128 words
    (``[PAD] [EOS] [BOS] [UNK] w0 ... w123``) into ``path``: a model directory that ``pbs generate``
    and ``from_pretrained`` load with no download."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[EOS]", "[BOS]", "[UNK]"] + [f"w{i}" for i in range(124)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]", unk_token="[UNK]"
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_model_config(kind), attn_implementation="sdpa")
    model.float().eval().save_pretrained(path)


def run_ranks(script: str, workdir: Path, world: int, timeout: float) -> list[dict]:
    """Runs ``script`` as ``python script WORKDIR RANK WORLD`` in ``world`` processes (the multi-process
    tests' workers, meeting through a file rendezvous in ``workdir``) and returns what each rank saved
    to ``workdir / f"rank{r}.pt"``; fails with a rank's output if it exits with an error."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(workdir), str(rank), str(world)], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} of {world} failed:\n{output[-6000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def default_sigint() -> None:
    """``preexec_fn`` for a subprocess a test interrupts: SIGINT back to its default, so that Python
    in the child turns it into KeyboardInterrupt. A test run started as a background job (``cmd &``
    in a script, as CI runners do) inherits SIGINT ignored, and the child would never see Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
