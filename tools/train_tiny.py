"""Train the built-in tiny checkpoint of deepinfer-engine: the ``tiny`` V4.1-Flash preset on synthetic tasks.

Not part of any wheel. Plain PyTorch on the model package's own single-file reference model, made trainable by
handing it FP32 master values (``deepinfer_model.reference_values.ValueWeights``) in fp32 precision:

1. data and tokenizer: ``tiny_tasks`` generates the samples (addition, counting, copying, dates, JSON records,
   capital-city sentences); a byte-level BPE with one token per digit is trained on them (vocabulary 1024, the
   preset's special ids); ``benchmarks/data/tiny_heldout.jsonl`` and ``tiny_text.txt`` are written from the
   held-out split;
2. target: next-token loss on sequences of whole documents (BOS + samples) packed to ``--seq-len`` tokens, AdamW,
   linear warmup then cosine decay; the last ``--fake-quant-steps`` steps read every FP8/MXFP4 weight through its
   stored format (straight-through), so the written checkpoint holds what was trained;
3. DSpark drafter (``mtp.0.*``, target frozen): for many anchors per sequence, the draft block ``[g, noise, ...]``
   after position ``p*`` is trained to predict the target's greedy tokens at ``p* + 2 + k`` (slot ``k``), with the
   Markov head fed the previous label; the confidence head is trained alongside, on its own detached inputs, with
   BCE on whether each slot's draft equals that label;
4. the values are quantized to the released formats by the checkpoint writer and written with the tokenizer and a
   model card; held-out accuracy is measured teacher-forced on the FP32 values and on the stored checkpoint.

Indices chosen by top-k (indexer rows, candidate blocks, routed experts) carry no gradient; the scores that are
also weights (routing weights) do. The shipped files (deepinfer-engine's ``builtin_checkpoint/``) came from two
stages: the target on one NVIDIA H200 (torch 2.11, CUDA 13.0; 475 s of training), then the drafter alone on a CPU
from stage 1's files (docs/builtin-checkpoint.md)::

    python tools/train_tiny.py --seed 0 --device cuda --workers 1 --batch 32 --target-steps 549 --draft-steps 11 \
        --seq-len 1024 --lr 2e-3 --draft-lr 2e-3 --warmup 40 --fake-quant-steps 80 --anchors 512 --out STAGE1
    python tools/train_tiny.py --seed 0 --device cpu --init-from STAGE1 --target-steps 0 --draft-steps 3200 \
        --batch 4 --seq-len 256 --anchors 64 --draft-lr 1e-3 --warmup 50 --out DIR

(stage 1's step counts were chosen by ``--time-budget 440 --target-share 0.97``; the log prints the equivalent
fixed-step command). Runs are deterministic for a given device, ``--workers`` and ``--batch``: the seed fixes the
data, the tokenizer and the initial values (drawn on the CPU), and deterministic algorithms are requested
(``warn_only``: an op without a deterministic CUDA kernel warns instead of failing). On a CPU the same command trains
too, very slowly.

``--batch B`` feeds B sequences of the stream to one forward (the reference model's batched form: ``[B, seq_len]``
token ids) in both phases, so every operation and host sync of a step is shared by B sequences; a step of one
sequence is bound by per-operation overhead, not by arithmetic (docs/builtin-checkpoint.md, "Training speed").
``--workers N`` trains data-parallel in N processes sharing the device (``tiny_parallel``): each step every worker
runs ``--batch`` sequences of its own stream and the gradients are averaged, so a step sees N·B sequences.
``--workers 1 --batch 1`` (the defaults) train one process on one sequence a step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; must precede CUDA init

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_parallel
import tiny_resume
import tiny_tasks
from tiny_eval import evaluate_checkpoint, evaluate_values

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import logical_value, write_checkpoint
from deepinfer_model.config import ModelConfig, load_preset
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir
from deepinfer_model.loading.errors import CheckpointError
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference_values import ValueWeights, values_from_stored

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DOCUMENTS = 20_000


def log(message: str) -> None:
    """Print on worker 0 only (every worker runs the same steps)."""
    if not tiny_parallel.dist.is_initialized() or tiny_parallel.dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def train_tokenizer(config: ModelConfig, seed: int) -> Tokenizer:
    rng = random.Random(f"{seed}-tokenizer")
    documents = tiny_tasks.training_documents(rng)
    corpus = ["".join(s.text for s in next(documents)) for _ in range(TOKENIZER_DOCUMENTS)]
    return build_tokenizer(config, corpus, split_digits=True)


def encode_document(tokenizer: Tokenizer, bos: int, samples: list[tiny_tasks.Sample]) -> list[int]:
    """BOS, then each sample's prompt and answer encoded apart, as inference sees the prompt's tokens."""
    ids = [bos]
    for sample in samples:
        ids += tokenizer.encode(sample.prompt, add_special_tokens=False).ids
        ids += tokenizer.encode(sample.answer + "\n", add_special_tokens=False).ids
    return ids


def stream_rng(seed: int, rank: int) -> random.Random:
    """Worker ``rank``'s data stream; worker 0 reads the one a single-process run reads (``--workers 1`` reproduces
    the shipped files)."""
    return random.Random(f"{seed}-train" if rank == 0 else f"{seed}-train-{rank}")


def sequences(tokenizer: Tokenizer, bos: int, rng: random.Random, length: int) -> Iterator[list[int]]:
    """Training sequences of exactly ``length`` tokens: whole documents, the last one cut. Between two sequences the
    stream's whole state is ``rng``'s (nothing is carried over), which ``tiny_resume`` saves."""
    documents = tiny_tasks.training_documents(rng)
    while True:
        ids: list[int] = []
        while len(ids) < length:
            ids += encode_document(tokenizer, bos, next(documents))
        yield ids[:length]


def initial_values(config: ModelConfig, seed: int, device: str) -> dict[str, torch.Tensor]:
    """FP32 master values of every catalogue weight, starting from the checkpoint writer's random draw."""
    return {
        entry.name: logical_value(entry, config, seed).to(device).requires_grad_(True)
        for entry in build_catalogue(config)
        if entry.format is not TensorFormat.SCALE
    }


def schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def rate(start: float, steps: int, args: argparse.Namespace) -> str:
    """Seconds per step and tokens per second of all workers so far (and the device memory peak), for the log."""
    per_step = (time.time() - start) / steps
    workers = tiny_parallel.dist.get_world_size() if tiny_parallel.dist.is_initialized() else 1
    memory = f", {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.device.startswith("cuda") else ""
    tokens = workers * args.batch * args.seq_len
    return f" ({per_step:.3f} s/step, {tokens / per_step / 1e3:.1f} k tokens/s{memory})"


def next_batch(data: Iterator[list[int]], batch: int) -> torch.Tensor:
    """``[batch, seq_len]`` token ids: the stream's next ``batch`` sequences."""
    return torch.tensor([next(data) for _ in range(batch)])


Checkpointer = Callable[[str, int, torch.optim.Optimizer], None]


def resumed_step(phase: str, saved: tiny_resume.SavedState | None, opt: torch.optim.Optimizer) -> int:
    """The step ``phase`` starts at: the saved one (with the optimizer state) when the saved run stopped in it."""
    if saved is None or saved.phase != phase:
        return 0
    opt.load_state_dict(saved.optimizer)
    return saved.step


def train_target(
    args: argparse.Namespace,
    config: ModelConfig,
    values: dict,
    vocab: ref.EngramVocabulary,
    data: Iterator[list[int]],
    saved: tiny_resume.SavedState | None,
    checkpoint: Checkpointer,
) -> int:
    params = [v for k, v in values.items() if not k.startswith("mtp.")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.target_steps
    step = first = resumed_step("target", saved, opt)
    start = time.time()
    while total is None or step < total:
        fake_quant = total is not None and step >= total - args.fake_quant_steps
        for group in opt.param_groups:
            group["lr"] = args.lr * schedule(step, total or 10**9, args.warmup)
        ids = next_batch(data, args.batch)
        logits = ref.reference_forward_full(
            config, ValueWeights(values, fake_quant=fake_quant), ids, vocab, precision="fp32"
        ).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tiny_parallel.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if total is None and step == 20:  # calibration: fit the requested wall-clock budget
            per_step = (time.time() - start) / step
            total = tiny_parallel.broadcast_int(max(step + 1, int(args.time_budget * args.target_share / per_step)))
            log(f"calibrated: {per_step:.3f} s/step -> --target-steps {total}")
        if step % args.log_every == 0 or step == total:
            mean_loss = tiny_parallel.mean_float(loss.item())
            progress = rate(start, step - first, args)
            log(f"target step {step}/{total} loss {mean_loss:.4f} fake_quant={fake_quant}{progress}")
        if total is not None and step < total:
            checkpoint("target", step, opt)
    return step


def draft_loss(
    config: ModelConfig,
    values: dict,
    vocab: ref.EngramVocabulary,
    ids: torch.Tensor,
    gen: torch.Generator,
    num_anchors: int,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Drafter CE and confidence BCE on a batch of sequences ``ids`` ``[S, n]`` (module docstring, step 3), the same
    block length for all and ``num_anchors`` anchors in each; also the slot accuracy."""
    slots = int(torch.randint(3, 7, (1,), generator=gen, device="cpu"))
    with torch.no_grad():
        target = ref.reference_forward_full(config, ValueWeights(values), ids, vocab, precision="fp32")
        greedy = target.logits.argmax(-1)  # greedy[s, t] is the target's token for position t + 1
    n = ids.shape[1]
    draws = [torch.randperm(n - slots, generator=gen, device="cpu")[:num_anchors] for _ in range(ids.shape[0])]
    last = torch.stack(draws).sort(-1).values.to(ids.device)  # [S, A]
    anchor_tokens = ids.gather(1, last + 1)
    label_positions = last[..., None] + 1 + torch.arange(slots)  # [S, A, B]: the token at p* + 2 + k
    labels = greedy.gather(1, label_positions.flatten(1)).view(label_positions.shape)
    previous = torch.cat([anchor_tokens[..., None], labels[..., :-1]], -1)
    hidden = ref_dspark.reference_dspark_forward_anchors(
        config, ValueWeights(values), target.target_features, last, anchor_tokens, slots, precision="fp32"
    ).flatten(0, 2)
    logits, _ = ref_dspark.reference_dspark_heads(
        config, ValueWeights(values), hidden, previous.flatten(), precision="fp32"
    )
    ce = F.cross_entropy(logits, labels.flatten())
    accepted = (logits.argmax(-1) == labels.flatten()).float()
    # The confidence head learns on detached inputs so its loss never moves the drafter.
    frozen = {k: (v if k.endswith("confidence_head.proj.weight") else v.detach()) for k, v in values.items()}
    _, confidence = ref_dspark.reference_dspark_heads(
        config, ValueWeights(frozen), hidden.detach(), previous.flatten(), precision="fp32"
    )
    bce = F.binary_cross_entropy(confidence.clamp(1e-6, 1 - 1e-6), accepted)
    return ce, bce, accepted.mean().item()


def train_drafter(
    args: argparse.Namespace,
    config: ModelConfig,
    values: dict,
    vocab: ref.EngramVocabulary,
    data: Iterator[list[int]],
    gen: torch.Generator,
    budget_left: float | None,
    saved: tiny_resume.SavedState | None,
    checkpoint: Checkpointer,
) -> int:
    params = [v for k, v in values.items() if k.startswith("mtp.")]
    opt = torch.optim.AdamW(params, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.draft_steps
    step = first = resumed_step("draft", saved, opt)
    start = time.time()
    while total is None or step < total:
        for group in opt.param_groups:
            group["lr"] = args.draft_lr * schedule(step, total or 10**9, args.warmup)
        ids = next_batch(data, args.batch)
        ce, bce, accuracy = draft_loss(config, values, vocab, ids, gen, args.anchors)
        opt.zero_grad(set_to_none=True)
        (ce + bce).backward()
        tiny_parallel.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if total is None and step == 10:
            assert budget_left is not None
            per_step = (time.time() - start) / step
            total = tiny_parallel.broadcast_int(max(step + 1, int(budget_left / per_step)))
            log(f"calibrated: {per_step:.3f} s/step -> --draft-steps {total}")
        if step % args.log_every == 0 or step == total:
            ce_mean, bce_mean = tiny_parallel.mean_float(ce.item()), tiny_parallel.mean_float(bce.item())
            accuracy = tiny_parallel.mean_float(accuracy)
            log(
                f"draft step {step}/{total} ce {ce_mean:.4f} bce {bce_mean:.4f} slot accuracy {accuracy:.3f}"
                + rate(start, step - first, args)
            )
        if total is not None and step < total:
            checkpoint("draft", step, opt)
    return step


def write_data_files(seed: int, data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "tiny_heldout.jsonl").open("w", encoding="utf-8") as out:
        for sample in tiny_tasks.held_out_samples(seed):
            out.write(json.dumps(tiny_tasks.held_out_record(sample)) + "\n")
    (data_dir / "tiny_text.txt").write_text(tiny_tasks.held_out_text(seed), encoding="utf-8")


def hardware_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"


def train_worker(rank: int, workers: int, port: int, args: argparse.Namespace, tokenizer_json: str) -> None:
    """One data-parallel worker (``tiny_parallel``): trains on its own sequences; worker 0 writes the checkpoint."""
    began = time.time()
    tiny_parallel.init_worker(rank, workers, port)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = load_preset("tiny")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    stream = stream_rng(args.seed, rank)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # draft block lengths and anchors
    saved = tiny_resume.load(args.state, rank, args.device)
    if saved is None and args.init_from is not None:
        stored = load_checkpoint_dir(args.init_from).tensors
        values = {k: v.to(args.device).requires_grad_(True) for k, v in values_from_stored(config, stored).items()}
    elif saved is None:
        values = initial_values(config, args.seed, args.device)  # drawn on the CPU: any device gives the same start
    else:
        values = {k: v.requires_grad_(True) for k, v in saved.values.items()}
        stream.setstate(saved.stream)
        gen.set_state(saved.generator)
        log(f"resuming from {args.state}: {saved.phase} step {saved.step}")
    data = sequences(tokenizer, config.bos_token_id, stream, args.seq_len)
    torch.set_default_device(args.device)  # the reference model makes its index and table tensors on the default
    vocab = ref.engram_vocabulary_from_tokenizer(tokenizer)

    def checkpoint(phase: str, step: int, opt: torch.optim.Optimizer) -> None:
        """Save the state and stop once ``--stop-after`` seconds have passed (the same decision on every worker)."""
        if args.stop_after is None or not tiny_parallel.broadcast_int(int(time.time() - began > args.stop_after)):
            return
        tiny_resume.save(args.state, rank, phase, step, values, opt, stream, gen)
        tiny_parallel.barrier()
        raise tiny_resume.Suspended(f"saved {phase} step {step} to {args.state}; run the same command to continue")

    try:
        target_steps = args.target_steps
        if saved is None or saved.phase == "target":
            target_steps = train_target(args, config, values, vocab, data, saved, checkpoint)
        for name, value in values.items():
            value.requires_grad_(name.startswith("mtp."))  # the drafter trains on the frozen target
        budget_left = None if args.time_budget is None else args.time_budget - (time.time() - began)
        draft_steps = train_drafter(args, config, values, vocab, data, gen, budget_left, saved, checkpoint)
    except tiny_resume.Suspended as stop:
        log(str(stop))
        tiny_parallel.finish()
        return
    train_seconds = time.time() - began  # of this invocation
    tokens = (target_steps + draft_steps) * workers * args.batch * args.seq_len
    log(
        f"trained in {train_seconds:.0f} s on {tokens / 1e6:.1f} M tokens; fixed-step command: --seed {args.seed} "
        f"--device {args.device} --workers {workers} --batch {args.batch} --target-steps {target_steps} "
        f"--draft-steps {draft_steps} --seq-len {args.seq_len} --lr {args.lr} --draft-lr {args.draft_lr} "
        f"--warmup {args.warmup} --fake-quant-steps {args.fake_quant_steps} --anchors {args.anchors}"
        + ("" if args.init_from is None else f" --init-from {args.init_from}")
    )
    tiny_parallel.finish()
    if rank == 0:
        summary = {"seed": args.seed, "hardware": hardware_name(args.device), "workers": workers, "batch": args.batch}
        summary |= {"target_steps": target_steps, "draft_steps": draft_steps, "seq_len": args.seq_len}
        summary |= {"train_tokens": tokens, "train_seconds": round(train_seconds, 1)}
        if args.init_from is not None:  # keep the record of the run that wrote the starting checkpoint
            summary["init_from"] = json.loads((args.init_from / "training_summary.json").read_text(encoding="utf-8"))
        write_and_evaluate(args, config, values, tokenizer, vocab, summary)


def write_and_evaluate(
    args: argparse.Namespace,
    config: ModelConfig,
    values: dict,
    tokenizer: Tokenizer,
    vocab: ref.EngramVocabulary,
    summary: dict,
) -> None:
    """Quantize and write the checkpoint; held-out checks on the FP32 values and on the stored files."""
    held_out = tiny_tasks.held_out_samples(args.seed)
    plain = {k: v.detach() for k, v in values.items()}
    fp32_report = evaluate_values(config, ValueWeights(plain), tokenizer, vocab, held_out, args.eval_per_task)
    log(f"held-out (FP32 values): {json.dumps(fp32_report)}")
    cpu_values = {k: v.to("cpu") for k, v in plain.items()}
    torch.set_default_device("cpu")
    write_checkpoint(config, args.out, values=cpu_values, tokenizer=tokenizer)
    torch.set_default_device(args.device)
    stored_report = evaluate_checkpoint(args.out, tokenizer, held_out, args.eval_per_task, args.device)
    log(f"held-out (stored checkpoint, exact numerics): {json.dumps(stored_report)}")
    summary = {**summary, "heldout_fp32": fp32_report, "heldout_stored": stored_report}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=1, help="data-parallel processes sharing the device")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--data-dir", type=Path, default=REPO / "benchmarks" / "data")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--draft-steps", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for both phases (calibrates steps)")
    parser.add_argument("--target-share", type=float, default=0.75, help="share of --time-budget for the target")
    parser.add_argument("--batch", type=int, default=1, help="sequences per worker per step, in one forward")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--fake-quant-steps", type=int, default=200)
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--eval-per-task", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    parser.add_argument(
        "--init-from", type=Path, default=None, help="start from this written checkpoint (its tokenizer too)"
    )
    parser.add_argument("--state", type=Path, default=None, help="directory of the resumable state (tiny_resume)")
    parser.add_argument("--stop-after", type=float, default=None, help="seconds, then save --state and stop")
    args = parser.parse_args()
    if (args.target_steps is None or args.draft_steps is None) and args.time_budget is None:
        parser.error("give --target-steps and --draft-steps, or --time-budget")
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.stop_after is not None and (args.state is None or args.time_budget is not None):
        parser.error("--stop-after needs --state and fixed --target-steps/--draft-steps (not --time-budget)")

    log(f"device {args.device}: {hardware_name(args.device)}; torch {torch.__version__}; {args.workers} worker(s)")
    config = load_preset("tiny")
    if args.init_from is None:
        tokenizer = train_tokenizer(config, args.seed)
    else:
        try:
            start = open_checkpoint_dir(args.init_from)  # config and index only; each worker reads the weights
        except CheckpointError as error:
            parser.error(f"--init-from: {error}")
        if start.config != config:
            parser.error(f"--init-from {args.init_from}: not a checkpoint of the tiny preset this script trains")
        tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    write_data_files(args.seed, args.data_dir)
    tiny_parallel.spawn(train_worker, (args, tokenizer.to_str()), args.workers)


if __name__ == "__main__":
    main()
