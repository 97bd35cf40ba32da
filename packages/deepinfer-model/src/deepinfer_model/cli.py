"""Command line of ``deepinfer-model`` (also ``python -m deepinfer_model``).

Commands:
    write-checkpoint --config PRESET_OR_CONFIG_JSON --out DIR [--seed N] [--max-shard-bytes N] [--fast-experts]
            [--workers N]
        Write a random checkpoint of the configuration in the released format (``checkpoint.writer``) and print its
        size and parameter count. ``--fast-experts`` draws the MXFP4 experts directly in stored form and
        ``--workers`` writes shards in parallel: what makes real-width presets (``v41-flash-scaled``) quick to write.
    inspect (--model DIR | --config PRESET_OR_CONFIG_JSON)
        Print the layer map (kind, sharing sources, Engram, YOCO side, RoPE) and parameter counts and bytes per
        storage format. With ``--model`` the checkpoint directory is validated first (headers and coverage; no tensor
        data is read).
    logits --model DIR --token-ids 1,2,3 --out FILE.safetensors [--dtype float32|bfloat16]
        One full forward of the layered model over the token ids (one request, prefilled from position 0) and write
        the logits of every position as tensor ``logits`` [num_tokens, vocab_size] float32. ``--dtype float32``
        runs ``ComputeMode.FP32`` (FP32 activations and caches, the parity-test numerics); ``bfloat16`` (the default)
        runs ``ComputeMode.EXACT``, the inference numerics (BF16 activations, FP8/FP4 caches). Meant for small
        checkpoints: the model is built and run on the CPU.

    rms --model DIR [--num-tokens N] [--seed N] [--dtype float32|bfloat16]
        Prefill N random in-vocabulary tokens (seeded) and print the root-mean-square of every block's output trunk:
        the check that a checkpoint's weight magnitudes (e.g. one from ``write-checkpoint``) keep activations O(1).

Errors print one line starting with ``error:`` and exit with status 2; there is no traceback.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from deepinfer_model.config import LayerKind, LayerSpec, ModelConfig, load_preset, preset_names
from deepinfer_model.loading.catalogue import CatalogueEntry, TensorFormat, build_catalogue, summarize

_KIND_LABEL = {LayerKind.SWA: "SWA", LayerKind.C1: "C1", LayerKind.C2: "C2", LayerKind.DSPARK: "DSpark"}
_FORMAT_LABEL = {
    TensorFormat.BF16: "BF16",
    TensorFormat.F32: "F32",
    TensorFormat.FP8_BLOCK: "FP8 e4m3, 32x32 UE8M0 scales",
    TensorFormat.FP8_ROW: "FP8 e4m3, 1x32 UE8M0 row scales (Engram)",
    TensorFormat.MXFP4: "MXFP4 e2m1 packed, 1x32 UE8M0 scales",
}


def config_from_argument(value: str) -> ModelConfig:
    """A preset name or the path of a ``config.json``."""
    if value in preset_names():
        return load_preset(value)
    path = Path(value)
    if path.is_file():
        return ModelConfig.from_json(path)
    raise ValueError(f"--config {value!r} is neither a preset ({', '.join(preset_names())}) nor a config.json file")


def _role(layer: LayerSpec, source: int, owns: bool) -> str:
    if not layer.is_compressed:
        return "-"
    return "source" if source == layer.layer_id and owns else f"<-{source}"


def layer_map_lines(config: ModelConfig) -> list[str]:
    """One row per runtime layer: kind, ratio, KV / index / index-K / candidate roles, Engram, YOCO side, RoPE."""
    t = config.text
    header = ("layer", "kind", "ratio", "kv", "index", "index-K", "candidate", "engram", "yoco", "rope")
    rows = [header]
    for layer in t.layers:
        name = (
            str(layer.layer_id) if layer.kind is not LayerKind.DSPARK else f"mtp.{layer.layer_id - t.num_hidden_layers}"
        )
        if layer.candidate_source is None:
            candidate = "-"
        else:
            candidate = "source" if layer.is_candidate_source else f"<-{layer.candidate_source}"
        yoco = "consumer" if layer.is_yoco_consumer else "producer"
        if layer.kind is LayerKind.DSPARK:
            yoco = "-"
        rope = f"{'yarn' if layer.uses_yarn else 'base'} {layer.rope_theta:g}"
        rows.append(
            (
                name,
                _KIND_LABEL[layer.kind],
                str(layer.compress_ratio) if layer.kind is not LayerKind.DSPARK else "-",
                _role(layer, layer.kv_source, layer.owns_compressor),
                _role(layer, layer.index_source, layer.owns_indexer),
                _role(layer, layer.index_k_source, layer.owns_index_k),
                candidate,
                "yes" if layer.has_engram else "-",
                yoco,
                rope,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_lines(entries: Sequence[CatalogueEntry]) -> list[str]:
    """Parameters and bytes per storage format (weights and their scales together)."""
    summary = summarize(entries)
    scale_bytes: dict[TensorFormat, int] = dict.fromkeys(_FORMAT_LABEL, 0)
    weight_bytes: dict[TensorFormat, int] = dict.fromkeys(_FORMAT_LABEL, 0)
    counts: dict[TensorFormat, int] = dict.fromkeys(_FORMAT_LABEL, 0)
    previous: TensorFormat | None = None
    for entry in entries:
        if entry.format is TensorFormat.SCALE:
            assert previous is not None
            scale_bytes[previous] += entry.num_bytes
            continue
        previous = entry.format
        weight_bytes[entry.format] += entry.num_bytes
        counts[entry.format] += 1
    lines = [f"{'format':<42}{'tensors':>9}{'parameters':>18}{'weight bytes':>18}{'scale bytes':>16}"]
    for fmt, label in _FORMAT_LABEL.items():
        if counts[fmt]:
            params = summary.parameters_by_format.get(fmt.value, 0)
            lines.append(f"{label:<42}{counts[fmt]:>9,}{params:>18,}{weight_bytes[fmt]:>18,}{scale_bytes[fmt]:>16,}")
    total_params = sum(summary.parameters_by_format.values())
    lines.append(
        f"{'total (tensors incl. scales)':<42}{summary.num_tensors:>9,}{total_params:>18,}{summary.num_bytes:>34,}"
    )
    return lines


def describe(config: ModelConfig) -> list[str]:
    """The full ``inspect`` report of a configuration."""
    t = config.text
    yoco = (
        f"n_prefill_layer = {t.n_prefill_layer}: producer layers 0-{t.n_prefill_layer - 1}, "
        f"consumer layers {t.n_prefill_layer}-{t.num_hidden_layers - 1}"
        if t.yoco_enabled
        else f"off (n_prefill_layer = {t.n_prefill_layer} >= num_hidden_layers)"
    )
    entries = build_catalogue(config)
    lines = [
        f"backbone layers {t.num_hidden_layers}, DSpark blocks {t.num_nextn_predict_layers}, hidden {t.hidden_size}, "
        f"heads {t.num_attention_heads} x {t.head_dim}, vocab {t.vocab_size}",
        f"MoE: {t.n_routed_experts} routed experts top-{t.num_experts_per_tok} + {t.n_shared_experts} shared, "
        f"intermediate {t.moe_intermediate_size}; DSpark MoE {t.dspark_n_routed_experts} top-"
        f"{t.dspark_num_experts_per_tok}",
        f"mHC streams {t.hc_mult} ({'shifted' if t.hc_shifted else 'non-shifted'}), sliding window {t.sliding_window}, "
        f"index top-k {t.index_topk}",
        f"YOCO: {yoco}",
        f"Engram layers: {list(t.engram_layer_ids) or 'none'}"
        + "".join(f"; layer {layer}: {t.engram_num_rows(layer):,} rows" for layer in t.engram_layer_ids),
        f"DSpark targets: {list(t.dspark_target_layer_ids)}",
        f"vision: {'yes' if config.vision is not None else 'no (text-only)'}",
        "",
        *layer_map_lines(config),
        "",
        *format_lines(entries),
    ]
    return lines


def _write(args: argparse.Namespace) -> int:
    from deepinfer_model.checkpoint.writer import write_checkpoint

    config = config_from_argument(args.config)
    out = Path(args.out)
    size = summarize(build_catalogue(config)).num_bytes
    probe = out if out.exists() else next((p for p in out.absolute().parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if size > free:
        raise ValueError(f"the checkpoint needs {size:,} bytes but {probe} has only {free:,} bytes free")
    write_checkpoint(
        config,
        out,
        seed=args.seed,
        max_shard_bytes=args.max_shard_bytes,
        fast_experts=args.fast_experts,
        num_workers=args.workers,
    )
    entries = build_catalogue(config)
    parameters = sum(summarize(entries).parameters_by_format.values())
    print(
        f"wrote {out}: {len(entries):,} tensors, {size:,} bytes (seed {args.seed}); {size / 1e9:.2f} GB, "
        f"{parameters:,} parameters"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.model is not None:
        from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir
        from deepinfer_model.loading.load import check_coverage

        checkpoint = open_checkpoint_dir(args.model)
        check_coverage(checkpoint, build_catalogue(checkpoint.config))
        print(f"checkpoint {checkpoint.path}: {len(checkpoint.shards)} shard(s), all tensors present and well-formed")
        config = checkpoint.config
    else:
        config = config_from_argument(args.config)
    print("\n".join(describe(config)))
    return 0


def parse_token_ids(value: str) -> list[int]:
    """``"1,2,3"`` → ``[1, 2, 3]``; raise ``ValueError`` naming the bad item."""
    items = [item.strip() for item in value.split(",")]
    ids = []
    for item in items:
        try:
            ids.append(int(item))
        except ValueError:
            raise ValueError(
                f"--token-ids {value!r}: {item!r} is not an integer (expected comma-separated ids, e.g. 1,2,3)"
            ) from None
    return ids


def _logits(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from deepinfer_model.full_forward import checkpoint_logits
    from deepinfer_model.layers.mode import ComputeMode

    token_ids = parse_token_ids(args.token_ids)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    mode = ComputeMode.FP32 if args.dtype == "float32" else ComputeMode.EXACT
    logits = checkpoint_logits(args.model, token_ids, mode)
    save_file({"logits": logits.contiguous()}, str(out))
    print(f"wrote {out}: logits {list(logits.shape)} float32 ({mode.value} mode)")
    return 0


def _rms(args: argparse.Namespace) -> int:
    import torch

    from deepinfer_model.full_forward import checkpoint_layer_rms
    from deepinfer_model.layers.mode import ComputeMode
    from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir

    if args.num_tokens < 1:
        raise ValueError(f"--num-tokens must be >= 1, got {args.num_tokens}")
    vocab_size = open_checkpoint_dir(args.model).config.text.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    token_ids = torch.randint(0, vocab_size, (args.num_tokens,), generator=generator).tolist()
    mode = ComputeMode.FP32 if args.dtype == "float32" else ComputeMode.EXACT
    rms = checkpoint_layer_rms(args.model, token_ids, mode)
    print(f"block output RMS over {args.num_tokens} random tokens (seed {args.seed}, {mode.value} mode):")
    for layer, value in enumerate(rms):
        print(f"  layer {layer:>3}: {value:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer-model", description="DeepSeek-V4.1-Flash model tools")
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write-checkpoint", help="write a random checkpoint in the released format")
    write.add_argument("--config", required=True, help=f"preset ({', '.join(preset_names())}) or config.json path")
    write.add_argument("--out", required=True, help="output directory")
    write.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    write.add_argument("--max-shard-bytes", type=int, default=4 * 1024**3, help="shard size limit in bytes")
    write.add_argument(
        "--fast-experts", action="store_true", help="draw MXFP4 experts directly in stored form (large checkpoints)"
    )
    write.add_argument("--workers", type=int, default=1, help="shards written in parallel (default 1)")
    write.set_defaults(handler=_write)
    inspect = commands.add_parser("inspect", help="print the layer map and the size per storage format")
    source = inspect.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory (validated, tensors not read)")
    source.add_argument("--config", help="preset name or config.json path")
    inspect.set_defaults(handler=_inspect)
    logits = commands.add_parser("logits", help="run one full forward and write the logits of every position")
    logits.add_argument("--model", required=True, help="checkpoint directory")
    logits.add_argument("--token-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    logits.add_argument("--out", required=True, help="output .safetensors file (tensor 'logits')")
    logits.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="float32: FP32 compute mode; bfloat16: exact (inference) mode (default)",
    )
    logits.set_defaults(handler=_logits)
    rms = commands.add_parser("rms", help="print each block's output RMS over a random prefill")
    rms.add_argument("--model", required=True, help="checkpoint directory")
    rms.add_argument("--num-tokens", type=int, default=64, help="random prompt length (default 64)")
    rms.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    rms.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="as for logits")
    rms.set_defaults(handler=_rms)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except (ValueError, OSError) as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr)
        return 2
    return status
