"""Random-weight Ouro checkpoints in the real HF layout, and the embedded default model.

A generated checkpoint has exactly the tensor names and shapes of the real one
(keys.expected_shapes), so the loader cannot tell them apart. Values are random
normal (std 0.02), norms are ones, and the exit gate is scaled so that its logit
is roughly N(gate_bias, GATE_LOGIT_STD^2) per token and loop (see docs/model.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from .build_tokenizer import ASSETS_DIR
from .config import OuroConfig
from .keys import expected_shapes

logger = logging.getLogger("ouro_fast")

PRESETS: dict[str, OuroConfig] = {
    "tiny": OuroConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        # Larger than the shipped tokenizer (1024), so vocabulary masking is exercised.
        vocab_size=1100,
        total_ut_steps=4,
        max_position_embeddings=2048,
    ),
    "ouro-1.4b": OuroConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=49152,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        total_ut_steps=4,
        early_exit_threshold=1.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_ids=(0,),
        torch_dtype="bfloat16",
    ),
}
PRESETS["ouro-2.6b"] = dataclasses.replace(PRESETS["ouro-1.4b"], num_hidden_layers=48)

DTYPES = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}
INIT_STD = 0.02
GATE_LOGIT_STD = 1.5
DEFAULT_GATE_BIAS = -1.0
# Bump when generated values or files change: it names the embedded default's cache folder.
GENERATOR_VERSION = 1
_CHUNK_ELEMS = 1 << 24  # float32 scratch of 64 MiB; part of the value stream, so fixed
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)
TRANSFORMERS_VERSION = "4.56.0"


def _resolve_preset(preset: str | OuroConfig) -> OuroConfig:
    if isinstance(preset, OuroConfig):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def gate_weight_std(hidden_size: int) -> float:
    """Gate weight std such that the logit's std is GATE_LOGIT_STD.

    The gate reads the output of model.norm (weight ones), whose squared entries
    average 1 per token, so w . h has variance std(w)^2 * hidden_size.
    """
    return GATE_LOGIT_STD / math.sqrt(hidden_size)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: a function of the checkpoint seed and the tensor name only."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def plan_safetensors(shapes: dict[str, tuple[int, ...]], dtype: str, metadata: dict | None = None):
    """(file prefix bytes, total file size) of a safetensors file holding shapes in order.

    The prefix is the 8-byte little-endian header length then the JSON header,
    padded with spaces to a multiple of 8 as safetensors itself does.
    """
    _check_dtype(dtype)
    torch_dtype, code = DTYPES[dtype]
    elem = torch.empty((), dtype=torch_dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * elem
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, len(prefix) + offset


def _tensor_chunks(
    name: str, shape: tuple[int, ...], cfg: OuroConfig, seed: int, gate_bias: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The values of one tensor, flat, in chunks of at most _CHUNK_ELEMS, already in dtype."""
    numel = math.prod(shape)
    if name.endswith(("norm.weight", "norm_2.weight")):
        yield torch.ones(numel, dtype=dtype)
        return
    if name == "model.early_exit_gate.bias":
        yield torch.full((numel,), gate_bias, dtype=dtype)
        return
    std = gate_weight_std(cfg.hidden_size) if name == "model.early_exit_gate.weight" else INIT_STD
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    scratch = torch.empty(min(numel, _CHUNK_ELEMS), dtype=torch.float32)
    for start in range(0, numel, _CHUNK_ELEMS):
        buf = scratch[: min(_CHUNK_ELEMS, numel - start)]
        buf.normal_(0.0, std, generator=gen)
        yield buf.to(dtype)


class _ProgressBar:
    """A one-line byte progress bar on stderr, redrawn at most once per percent."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done, self.shown = 0, -1

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        pct = 100 * self.done // self.total
        if self.enabled and pct != self.shown:
            self.shown = pct
            bar = "#" * (pct // 4) + "." * (25 - pct // 4)
            unit, scale = ("GB", 1e9) if self.total >= 1e9 else ("MB", 1e6)
            size = f"{self.done / scale:.2f}/{self.total / scale:.2f} {unit}"
            sys.stderr.write(f"\r{self.label} [{bar}] {pct:3d}% {size}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def write_random_safetensors(
    path: Path,
    cfg: OuroConfig,
    seed: int,
    dtype: str,
    gate_bias: float,
    progress: bool = False,
    metadata: dict | None = None,
) -> None:
    """Stream a random-weight model.safetensors for cfg to path, one chunk in memory at a time."""
    shapes = expected_shapes(cfg)
    torch_dtype = DTYPES[dtype][0]
    prefix, total = plan_safetensors(shapes, dtype, metadata)
    bar = _ProgressBar(path.name, total, progress)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(prefix)
        bar.advance(len(prefix))
        for name, shape in shapes.items():
            for chunk in _tensor_chunks(name, shape, cfg, seed, gate_bias, torch_dtype):
                f.write(chunk.view(torch.uint8).numpy().data)
                bar.advance(chunk.numel() * chunk.element_size())
    if partial.stat().st_size != total:
        raise RuntimeError(f"{partial}: wrote {partial.stat().st_size} bytes, expected {total}")
    os.replace(partial, path)


def checkpoint_config(cfg: OuroConfig, provenance: dict) -> dict:
    """config.json: OuroConfig's fields plus the fields the real file carries that we ignore."""
    d = cfg.to_dict()
    d.update(
        {
            "attention_dropout": 0.0,
            "initializer_range": INIT_STD,
            "max_window_layers": cfg.num_hidden_layers,
            "use_cache": True,
            "use_sliding_window": False,
            "transformers_version": TRANSFORMERS_VERSION,
            "ouro_fast_random_init": provenance,
        }
    )
    return dict(sorted(d.items()))


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path, model_max_length: int) -> None:
    """The shipped tokenizer into out_dir, plus out_dir/tokenizer/ for transformers' AutoTokenizer.

    The subfolder adds a config.json whose model_type transformers knows, so that
    `AutoTokenizer.from_pretrained(out_dir / "tokenizer")` works offline (Ouro's own
    model_type is unknown to transformers without its remote code).
    """
    sub = out_dir / "tokenizer"
    sub.mkdir(exist_ok=True)
    tok_config = json.loads((ASSETS_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config["model_max_length"] = model_max_length
    vocab = json.loads((ASSETS_DIR / "vocab.json").read_text(encoding="utf-8"))
    for target in (out_dir, sub):
        for name in _TOKENIZER_FILES:
            if name == "tokenizer_config.json":
                _dump(target / name, tok_config)
            else:
                shutil.copyfile(ASSETS_DIR / name, target / name)
    _dump(
        sub / "config.json",
        {
            "model_type": "gpt2",
            "vocab_size": len(vocab),
            "bos_token_id": 0,
            "eos_token_id": 0,
            "n_positions": model_max_length,
        },
    )


def make_checkpoint(
    preset: str | OuroConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    gate_bias: float = DEFAULT_GATE_BIAS,
    progress: bool = True,
) -> Path:
    """Write a random-weight checkpoint directory; returns its path.

    Files: config.json, generation_config.json, model.safetensors, the tokenizer
    files and tokenizer/. The same (preset, seed, dtype, gate_bias) always gives
    the same bytes on one torch version. Peak memory is one 64 MiB chunk.
    """
    _check_dtype(dtype)
    cfg = dataclasses.replace(_resolve_preset(preset), torch_dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    provenance = {
        "preset": preset if isinstance(preset, str) else "custom",
        "seed": seed,
        "gate_bias": gate_bias,
        "gate_logit_std": GATE_LOGIT_STD,
        "generator_version": GENERATOR_VERSION,
    }
    _dump(out / "config.json", checkpoint_config(cfg, provenance))
    eos = list(cfg.eos_token_ids)
    _dump(
        out / "generation_config.json",
        {
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": cfg.bos_token_id,
            "transformers_version": TRANSFORMERS_VERSION,
        },
    )
    write_tokenizer_files(out, cfg.max_position_embeddings)
    meta = {k: str(v) for k, v in provenance.items()}
    write_random_safetensors(out / "model.safetensors", cfg, seed, dtype, gate_bias, progress, meta)
    return out


def _assets_digest() -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        h.update((ASSETS_DIR / name).read_bytes())
    return h.hexdigest()[:10]


def default_model_dir() -> Path:
    """The embedded default model: the tiny preset (float32, seed 0), generated on first use.

    It lives in $OURO_FAST_CACHE (default ~/.cache/ouro_fast) under a folder named
    for the preset, generator version and tokenizer. Creation is atomic (a temp
    folder renamed into place), so concurrent first uses are safe.
    """
    root = Path(os.environ.get("OURO_FAST_CACHE") or Path.home() / ".cache" / "ouro_fast")
    final = root / f"tiny-float32-seed0-v{GENERATOR_VERSION}-{_assets_digest()}"
    logger.warning("using the embedded default model %s: its weights are randomly initialised", final)
    if (final / "model.safetensors").is_file() and (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        make_checkpoint("tiny", tmp, seed=0, dtype="float32", progress=False)
        if final.exists() and not (final / "model.safetensors").is_file():
            # A folder left incomplete by hand: move it aside rather than mix files.
            shutil.rmtree(final.rename(tmp.with_name(tmp.name + ".stale")))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
            # Another process finished first; its copy is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def add_make_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of `ouro-fast make-checkpoint`."""
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="output directory (created if needed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument(
        "--gate-bias",
        type=float,
        default=DEFAULT_GATE_BIAS,
        help=f"centre of the exit-gate logit (std {GATE_LOGIT_STD}); higher means earlier exits",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run_make_checkpoint)


def _run_make_checkpoint(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():
        print(f"error: {args.out} exists and is not a directory", file=sys.stderr)
        return 2
    out = make_checkpoint(
        args.preset, args.out, args.seed, args.dtype, args.gate_bias, progress=not args.quiet
    )
    print(out)
    return 0
