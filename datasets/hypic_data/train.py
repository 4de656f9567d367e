"""Train a small Qwen3.5-architecture hybrid model on the synthetic multi-document QA data.

The model is transformers' ``Qwen3_5ForCausalLM``: gated DeltaNet (linear attention)
layers and full-attention layers in a 3:1 pattern, partial rotary embeddings (0.25) and
twice as many linear value heads as key heads, i.e. the structure HYPIC serves, at 5-20 M
parameters.

Each training sequence is one example, tokenized exactly as the engine tokenizes a
request: every prompt part (instruction, each document, the question part) encoded on
its own and concatenated, then `` answer`` and ``<|endoftext|>``. The loss is

    loss = mean CE over all tokens + answer_weight * mean CE over the answer tokens

(answer tokens include the closing eos). The first term teaches the language of the
documents; the second keeps the rare answer tokens, about 0.3 % of a sequence, from being
drowned out. ``--answer-weight 0`` gives plain language-model loss.

On CPU transformers would pick flash-linear-attention's Triton kernels (which need a GPU)
whenever the package is installed; ``qwen3_5_classes`` hides the package on CPU so that
the PyTorch reference path is used. On CUDA the FLA kernels are used when installed.

Command line: ``python -m hypic_data.train --data datasets/synthetic_qa --tokenizer
PATH --out runs/tiny``; see ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from hypic.kernels.gated_delta.transformers_layout import training_gated_delta_rule
from hypic_data.synthetic_qa import (EOS_TOKEN, PAD_TOKEN, QUESTION_TEMPLATE, prompt_parts,
                                     read_jsonl)
from hypic_data.tokenizer import encode_parts, load_tokenizer, special_token_ids, tokenizer_path

IGNORE_INDEX = -100
LOG_FILE = "train_log.jsonl"
EXTRA_KINDS = ("any", "single_hop", "multi_hop")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the hybrid model (defaults: about 10 M parameters with vocab 4096)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    full_attention_interval: int = 4  # every 4th layer is full attention: 3 linear : 1 full
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4  # value heads are twice as many (Qwen3.5 GQA layout)
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True


@dataclass
class TrainConfig:
    """Everything a training run depends on; saved beside each checkpoint."""

    data: Path
    tokenizer: Path
    out: Path
    steps: int = 3000
    batch_size: int = 8
    seq_len: int = 2048
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    answer_weight: float = 1.0
    extra_questions: int = 0
    extra_kind: str = "any"  # "single_hop": use only single-hop extra questions
    copy_rows: int = 0  # extra rows per batch of a random token run repeated (induction drill)
    copy_length: int = 96
    schedule_minutes: float | None = None  # fit the step count to this much training time
    eval_every: int = 0  # validation answer accuracy every N steps (0: only at the end)
    eval_examples: int = 200
    workers: int = 1  # processes encoding the training set
    kernel: str = "auto"  # gated delta rule: "auto" (FLA on CUDA) or "torch" (ours everywhere)
    long_memory_init: bool = True
    memory_heads: int = 0  # per linear layer, value heads given a fixed document-scale decay
    memory_decay: float = 0.005  # their per-token log decay (1 / memory_decay tokens of memory)
    seed: int = 0
    device: str = "auto"
    max_minutes: float | None = None
    save_every: int = 500
    keep_checkpoints: int = 2
    max_examples: int | None = None
    init_from: Path | None = None
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class TrainResult:
    """What a run did: per-step losses, steps completed, where the model was saved."""

    losses: list[float]
    steps: int
    out: Path
    stopped_early: bool


@dataclass(frozen=True)
class Encoded:
    """One tokenized training sequence; tokens from ``answer_start`` on are the answer.

    With extra questions (``--extra-questions``) the sequence goes on after the answer's
    eos with further ``question part, answer, eos``: then the first answer ends at
    ``answer_end`` and ``extra_answers`` holds the (start, end) spans of the later answers.
    """

    ids: list[int]
    answer_start: int
    answer_end: int | None = None
    extra_answers: tuple[tuple[int, int], ...] = ()

    @property
    def answer_spans(self) -> list[tuple[int, int]]:
        """(start, end) of every answer, each with its eos, in ``ids``."""
        end = len(self.ids) if self.answer_end is None else self.answer_end
        return [(self.answer_start, end), *self.extra_answers]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cpu``/``cuda`` as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device(name)


def qwen3_5_classes(device: torch.device) -> tuple[type, type]:
    """(Qwen3_5TextConfig, Qwen3_5ForCausalLM), importing so that CPU runs work.

    Off CUDA, flash-linear-attention is hidden before transformers' modeling module is
    first imported, because transformers binds FLA's GPU-only kernels at import time.
    """
    if device.type != "cuda":
        sys.modules.setdefault("fla", None)
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5TextConfig, Qwen3_5ForCausalLM


@contextlib.contextmanager
def training_kernels(device: torch.device, kernel: str = "auto") -> Iterator[None]:
    """Inside: transformers' Qwen3.5 runs ``training_gated_delta_rule(device)``.

    Same math as transformers' fallback (see the kernel tests), with a far cheaper backward
    on CPU and FLA's kernel on CUDA. The module's own rule is restored on exit, so models
    loaded elsewhere (the test oracle) stay pure transformers.
    """
    qwen3_5_classes(device)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    rule = training_gated_delta_rule(device, use_fla=kernel == "auto")
    modeling_qwen3_5.torch_chunk_gated_delta_rule = rule
    try:
        yield
    finally:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = original


def build_model(config: ModelConfig, eos_id: int, pad_id: int, device: torch.device) -> Any:
    """A freshly initialised ``Qwen3_5ForCausalLM`` (seed torch first for reproducibility)."""
    config_cls, model_cls = qwen3_5_classes(device)
    hf_config = config_cls(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        full_attention_interval=config.full_attention_interval,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=2 * config.linear_num_key_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        partial_rotary_factor=config.partial_rotary_factor,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                         "partial_rotary_factor": config.partial_rotary_factor},
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    return model_cls(hf_config).to(device)


def load_model(model_dir: str | Path, device: str = "auto",
               dtype: torch.dtype = torch.float32) -> tuple[torch.device, Any]:
    """(device, model) for a saved checkpoint, in eval mode; works on CPU (see above).

    Computes in ``dtype`` whatever the weights were stored in (transformers would otherwise
    run the shipped bf16 weights in bf16).
    """
    torch_device = resolve_device(device)
    _, model_cls = qwen3_5_classes(torch_device)
    model = model_cls.from_pretrained(str(model_dir), dtype=dtype).to(torch_device).eval()
    return torch_device, model


def long_memory_init(model: torch.nn.Module, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Re-initialise every Gated DeltaNet layer's ``dt_bias`` as Mamba-2 / FLA do.

    transformers initialises ``dt_bias`` to 1 (with A = exp(A_log) in 0.01..16), so the
    per-token decay exp(-A softplus(a + dt_bias)) starts far below 1 and the recurrent state
    forgets everything within a few tokens; the default model trained that way on CPU never
    left that regime (its linear layers carry nothing across documents). Here
    softplus(dt_bias) = dt, log-uniform in [dt_min, dt_max], so many heads start with long
    memory. Draws from torch's global generator (seed it first).
    """
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "dt_bias") and hasattr(module, "A_log"):
                low, high = math.log(dt_min), math.log(dt_max)
                dt = torch.exp(torch.rand(module.dt_bias.shape) * (high - low) + low).clamp_min(1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def fix_document_memory(model: torch.nn.Module, heads: int, decay: float) -> None:
    """Give the first ``heads`` value heads of every Gated DeltaNet layer the input-independent
    per-token decay exp(-decay) (A = 1, softplus(dt_bias) = decay, their ``in_proj_a`` rows zero) and
    keep it through training (those entries' gradients are masked). A trained model's heads decay
    either within a few tokens or hardly at all, and both make naive addition nearly exact; memory
    on the scale of a document (1 / decay tokens) is what it gets wrong."""
    layers = [m for m in model.modules() if all(hasattr(m, a) for a in ("A_log", "dt_bias", "in_proj_a"))]
    if heads <= 0 or not layers:
        return
    if heads > layers[0].A_log.shape[0] or not 0 < decay < 1:
        raise ValueError(f"memory_heads {heads} / memory_decay {decay}: at most "
                         f"{layers[0].A_log.shape[0]} heads, decay in (0, 1)")
    with torch.no_grad():
        for layer in layers:
            layer.A_log[:heads] = 0.0
            layer.dt_bias[:heads] = math.log(math.expm1(decay))  # inverse softplus
            layer.in_proj_a.weight[:heads] = 0.0
            keep = torch.ones_like(layer.A_log)
            keep[:heads] = 0.0
            for param, mask in ((layer.A_log, keep), (layer.dt_bias, keep), (layer.in_proj_a.weight, keep[:, None])):
                param.register_hook(functools.partial(torch.mul, mask))


def load_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy the weights of a saved checkpoint into ``model`` (shapes must match).

    Used to continue training in stages (e.g. short sequences first, then long ones);
    the optimizer state and schedule start afresh.
    """
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(f"{directory}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def encode_example(tokenizer: Tokenizer, example: dict, eos_id: int,
                   extra_questions: int = 0, extra_kind: str = "any") -> Encoded:
    """Prompt parts encoded one by one (as the engine does), then `` answer`` and eos.

    With ``extra_questions`` > 0, up to that many of the example's ``extra_questions``
    follow, each as question part, `` answer`` and eos: more answer tokens per document
    token processed. ``extra_kind`` = ``single_hop`` skips the multi-hop ones.
    """
    if extra_kind not in EXTRA_KINDS:
        raise ValueError(f"extra_kind must be one of {EXTRA_KINDS}, got {extra_kind!r}")
    prompt = encode_parts(tokenizer, prompt_parts(example))
    ids = prompt + encode_parts(tokenizer, [" " + example["answer"]]) + [eos_id]
    answer_end, spans = len(ids), []
    extras = [e for e in example.get("extra_questions", [])
              if extra_kind == "any" or e["kind"] == extra_kind]
    for extra in extras[:extra_questions]:
        ids += encode_parts(tokenizer, [QUESTION_TEMPLATE.format(question=extra["question"])])
        start = len(ids)
        ids += encode_parts(tokenizer, [" " + extra["answer"]]) + [eos_id]
        spans.append((start, len(ids)))
    return Encoded(ids, len(prompt), answer_end if spans else None, tuple(spans))


def fit_to_length(tokenizer: Tokenizer, example: dict, eos_id: int, seq_len: int,
                  extra_questions: int = 0, extra_kind: str = "any") -> Encoded | None:
    """Encode ``example``, dropping distractor documents from the end until it fits.

    Supporting documents are kept, so the shortened example stays answerable; None when
    even the supporting documents alone do not fit. Extra questions whose supporting
    documents were dropped are dropped too.
    """
    docs = list(enumerate(example["documents"]))
    keep = set(example["supporting_docs"])
    while True:
        kept = {k for k, _ in docs}
        extras = [e for e in example.get("extra_questions", [])
                  if set(e["supporting_docs"]) <= kept]
        trimmed = {**example, "documents": [d for _, d in docs], "extra_questions": extras}
        encoded = encode_example(tokenizer, trimmed, eos_id, extra_questions, extra_kind)
        if len(encoded.ids) <= seq_len:
            return encoded
        drop = next((k for k in range(len(docs) - 1, -1, -1) if docs[k][0] not in keep), None)
        if drop is None:
            return None
        del docs[drop]


def encode_examples(examples: Sequence[dict], tokenizer: Tokenizer, eos_id: int, seq_len: int,
                    extra_questions: int = 0, extra_kind: str = "any",
                    workers: int = 1) -> list[Encoded | None]:
    """``fit_to_length`` of every example, in order; ``workers`` > 1 encodes in processes."""
    fit = functools.partial(fit_to_length, tokenizer, eos_id=eos_id, seq_len=seq_len,
                            extra_questions=extra_questions, extra_kind=extra_kind)
    if workers <= 1:
        return [fit(example) for example in examples]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(fit, examples, chunksize=256)


def load_training_set(config: TrainConfig, tokenizer: Tokenizer, eos_id: int) -> list[Encoded]:
    """The train split, encoded and fitted to ``seq_len`` (unfittable examples skipped)."""
    examples = read_jsonl(Path(config.data) / "train.jsonl")[: config.max_examples]
    encoded = encode_examples(examples, tokenizer, eos_id, config.seq_len,
                              config.extra_questions, config.extra_kind, config.workers)
    kept = [e for e in encoded if e is not None]
    if not kept:
        raise ValueError(f"no training example fits in --seq-len {config.seq_len}")
    return kept


def load_validation_set(config: TrainConfig, tokenizer: Tokenizer,
                        eos_id: int) -> list[tuple[str, Encoded]]:
    """(kind, prompt + answer + eos) of the first ``eval_examples`` validation examples.

    Empty when the split is missing or ``eval_examples`` is 0. Examples that do not fit in
    ``seq_len`` lose distractors, as in training.
    """
    path = Path(config.data) / "validation.jsonl"
    if config.eval_examples <= 0 or not path.exists():
        return []
    examples = read_jsonl(path)[: config.eval_examples]
    encoded = encode_examples(examples, tokenizer, eos_id, config.seq_len)
    return [(ex["kind"], e) for ex, e in zip(examples, encoded) if e is not None]


def batch_order(count: int, batch_size: int, seed: int) -> list[list[int]]:
    """An epoch of batches: a seeded permutation cut into full batches."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    size = min(batch_size, count)
    return [order[i:i + size] for i in range(0, count - size + 1, size)]


def make_batch(items: Sequence[Encoded], pad_id: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels, answer_mask) for next-token prediction.

    Right padding needs no attention mask: every layer is causal, so real tokens never
    see the pads that follow them, and pads carry no loss.
    """
    width = max(len(item.ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    answer = torch.zeros((len(items), width), dtype=torch.bool)
    for row, item in enumerate(items):
        ids[row, : len(item.ids)] = torch.tensor(item.ids)
        labels[row, : len(item.ids)] = torch.tensor(item.ids)
        for start, end in item.answer_spans:
            answer[row, start:end] = True
    return ids.to(device), labels.to(device), answer.to(device)


def qa_loss(logits: torch.Tensor, labels: torch.Tensor, answer: torch.Tensor,
            answer_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, lm, answer) losses; position t predicts token t + 1."""
    target, is_answer = labels[:, 1:], answer[:, 1:]
    token_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target,
                                 ignore_index=IGNORE_INDEX, reduction="none")
    valid = target != IGNORE_INDEX
    lm = token_loss[valid].mean()
    ans = token_loss[is_answer & valid].mean()
    return lm + answer_weight * ans, lm, ans


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio`` of the peak at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepPlan:
    """How many steps the run takes; ``schedule_minutes`` may revise it after a probe."""

    total: int


def fitted_steps(config: TrainConfig, done: int, elapsed_s: float, step_s: float) -> int:
    """Steps that end the run after ``schedule_minutes`` at ``step_s`` seconds a step.

    Capped by ``--steps`` and never below the steps already done plus one.
    """
    left = 60.0 * config.schedule_minutes - elapsed_s
    return max(done + 1, min(config.steps, done + int(left / step_s)))


def make_optimizer(model: torch.nn.Module, config: TrainConfig,
                   plan: StepPlan) -> tuple[Any, Any]:
    """AdamW (no decay on norms and biases) with the warm-up + cosine schedule over
    ``plan.total`` steps (read at every step, so a revised plan bends the schedule)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, config.warmup_steps, plan.total, config.min_lr_ratio))
    return optimizer, schedule


def save_checkpoint(model: Any, config: TrainConfig, directory: Path, step: int) -> Path:
    """``save_pretrained`` + tokenizer.json (+ tokenizer_config.json) + training config."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    source, target = tokenizer_path(config.tokenizer), directory / "tokenizer.json"
    if not (target.exists() and target.samefile(source)):  # --out may hold the tokenizer
        shutil.copyfile(source, target)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                        "pad_token": PAD_TOKEN, "model_max_length": config.seq_len,
                        "clean_up_tokenization_spaces": False}
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_json(directory / "training_config.json", {**_jsonable(config), "step": step})
    return directory


def _jsonable(config: TrainConfig) -> dict:
    """The config as plain JSON values."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _prune_checkpoints(out: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` periodic checkpoints written by this script."""
    checkpoints = sorted(out.glob("checkpoint-*"))
    for old in checkpoints[: max(0, len(checkpoints) - keep)]:
        shutil.rmtree(old)


def copy_drill(rng: random.Random, vocab: Sequence[int], length: int) -> Encoded:
    """A random run of ``length`` token ids followed by the same run; the repeat is the answer.

    Predicting the repeat needs a copy (induction) circuit, the mechanism that answering
    from documents relies on; rows like this make a small model grow it early.
    """
    run = [rng.choice(vocab) for _ in range(length)]
    return Encoded(run + run, length)


class _Batches:
    """Endless stream of batches, reshuffled each epoch from the run's seed."""

    def __init__(self, data: list[Encoded], batch_size: int, seed: int,
                 drill: tuple[int, int, Sequence[int]] = (0, 0, ())) -> None:
        self.data, self.batch_size, self.seed, self.epoch = data, batch_size, seed, 0
        self.pending: list[list[int]] = []
        self.drill_rows, self.drill_length, self.vocab = drill
        self.rng = random.Random(f"copy-drill|{seed}")

    def next(self) -> list[Encoded]:
        """The next batch of encoded examples (plus the copy-drill rows, if any)."""
        if not self.pending:
            self.pending = batch_order(len(self.data), self.batch_size, self.seed + self.epoch)
            self.epoch += 1
        drills = [copy_drill(self.rng, self.vocab, self.drill_length)
                  for _ in range(self.drill_rows)]
        return [self.data[i] for i in self.pending.pop(0)] + drills


def train_step(model: Any, batch: list[Encoded], pad_id: int, config: TrainConfig,
               device: torch.device) -> tuple[float, float, float]:
    """Forward + backward of one batch; returns (total, lm, answer) loss values."""
    ids, labels, answer = make_batch(batch, pad_id, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=ids, use_cache=False).logits
    total, lm, ans = qa_loss(logits, labels, answer, config.answer_weight)
    total.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    return total.item(), lm.item(), ans.item()


@torch.no_grad()
def greedy_answer_matches(model: Any, items: Sequence[Encoded], pad_id: int,
                          device: torch.device, batch_size: int = 16) -> list[bool]:
    """Whether greedy decoding after each prompt gives exactly its answer tokens and eos.

    One teacher-forced forward over prompt + answer + eos: greedy decoding reproduces the
    answer iff the argmax at every answer position is the next answer token. A strict
    form of exact match (a greedy answer that differs only in punctuation counts wrong).
    """
    matches = []
    for first in range(0, len(items), batch_size):
        ids, _, answer = make_batch(items[first:first + batch_size], pad_id, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, use_cache=False).logits
        hit = logits[:, :-1].argmax(-1) == ids[:, 1:]
        matches += (hit | ~answer[:, 1:]).all(-1).tolist()
    return matches


def answer_accuracy(model: Any, validation: Sequence[tuple[str, Encoded]], pad_id: int,
                    device: torch.device) -> dict[str, float]:
    """``greedy_answer_matches`` as a fraction per question kind (``val_single_hop``, ...)."""
    was_training = model.training
    model.eval()
    matches = greedy_answer_matches(model, [e for _, e in validation], pad_id, device)
    model.train(was_training)
    kinds = sorted({kind for kind, _ in validation})
    return {f"val_{kind}": sum(m for (k, _), m in zip(validation, matches) if k == kind)
            / sum(k == kind for k, _ in validation) for kind in kinds}


@dataclass
class _Run:
    """The live objects of one training run."""

    config: TrainConfig
    device: torch.device
    model: Any
    batches: _Batches
    optimizer: Any
    schedule: Any
    pad_id: int
    out: Path
    plan: StepPlan
    validation: list[tuple[str, Encoded]]
    probe_start: float | None = None  # when the timed probe steps began


def _start_run(config: TrainConfig) -> _Run:
    """Seed everything, load tokenizer and data, build model and optimizer."""
    device = resolve_device(config.device)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.tokenizer)
    eos_id, pad_id = special_token_ids(tokenizer)
    model_config = dataclasses.replace(config.model, vocab_size=tokenizer.get_vocab_size())
    model = build_model(model_config, eos_id, pad_id, device)
    if config.long_memory_init:
        long_memory_init(model)
    if config.init_from is not None:
        load_weights(model, config.init_from)
    fix_document_memory(model, config.memory_heads, config.memory_decay)
    vocab = [i for i in range(tokenizer.get_vocab_size()) if i not in (eos_id, pad_id)]
    batches = _Batches(load_training_set(config, tokenizer, eos_id), config.batch_size,
                       config.seed, (config.copy_rows, config.copy_length, vocab))
    plan = StepPlan(config.steps)
    optimizer, schedule = make_optimizer(model, config, plan)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / LOG_FILE).write_text("", encoding="utf-8")  # a new run starts a new log
    validation = load_validation_set(config, tokenizer, eos_id)
    return _Run(config, device, model, batches, optimizer, schedule, pad_id, out, plan,
                validation)


def _step(run: _Run, step: int, start: float) -> dict:
    """One optimisation step; returns its log record."""
    run.model.train()
    total, lm, ans = train_step(run.model, run.batches.next(), run.pad_id, run.config, run.device)
    lr = run.optimizer.param_groups[0]["lr"]  # the rate this step used
    run.optimizer.step()
    _maybe_refit(run, step + 1, start)  # before the schedule computes the next step's rate
    run.schedule.step()
    run.optimizer.zero_grad(set_to_none=True)
    record = {"step": step + 1, "loss": total, "lm_loss": lm, "answer_loss": ans,
              "lr": lr, "seconds": round(time.monotonic() - start, 3)}
    _log(run, record)
    return record


def _log(run: _Run, record: dict) -> None:
    """Append one record to the run's JSONL log."""
    with open(run.out / LOG_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _evaluate(run: _Run, steps_done: int, bar: Any) -> None:
    """Log (and print) the validation answer accuracy per kind."""
    if not run.validation:
        return
    scores = answer_accuracy(run.model, run.validation, run.pad_id, run.device)
    _log(run, {"step": steps_done, **scores})
    bar.write(f"step {steps_done}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))


PROBE_STEPS = (5, 25)  # steps timed to fit --schedule-minutes (after warm-up effects)


def _maybe_refit(run: _Run, steps_done: int, start: float) -> None:
    """At the probe's ends, time the steps and fit ``plan.total`` to ``schedule_minutes``."""
    if run.config.schedule_minutes is None:
        return
    if steps_done == PROBE_STEPS[0]:
        run.probe_start = time.monotonic()
    elif steps_done == PROBE_STEPS[1] and run.probe_start is not None:
        step_s = (time.monotonic() - run.probe_start) / (PROBE_STEPS[1] - PROBE_STEPS[0])
        run.plan.total = fitted_steps(run.config, steps_done, time.monotonic() - start, step_s)


def _maybe_checkpoint(run: _Run, steps_done: int) -> None:
    """Save a periodic checkpoint every ``save_every`` steps (not at the very end)."""
    every = run.config.save_every
    if every and steps_done % every == 0 and steps_done < run.plan.total:
        save_checkpoint(run.model, run.config, run.out / f"checkpoint-{steps_done:06d}",
                        steps_done)
        _prune_checkpoints(run.out, run.config.keep_checkpoints)


def train(config: TrainConfig) -> TrainResult:
    """Run training as configured; saves periodic checkpoints and the final model."""
    device = resolve_device(config.device)
    with training_kernels(device, config.kernel):
        return _train(config)


def _train(config: TrainConfig) -> TrainResult:
    """The training loop (under ``training_kernels``)."""
    from tqdm import tqdm  # progress bar only; keeps module import light

    run = _start_run(config)
    bar = tqdm(total=run.plan.total, desc="train", disable=not config.progress, file=sys.stderr)
    bar.write(f"model: {count_parameters(run.model) / 1e6:.2f} M parameters on {run.device}; "
              f"{len(run.batches.data)} training sequences")
    start, losses, stopped = time.monotonic(), [], False
    while len(losses) < run.plan.total:
        record = _step(run, len(losses), start)
        losses.append(record["loss"])
        bar.total = run.plan.total
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", ans=f"{record['answer_loss']:.3f}",
                        lr=f"{record['lr']:.2e}")
        _maybe_checkpoint(run, len(losses))
        if config.eval_every and len(losses) % config.eval_every == 0:
            _evaluate(run, len(losses), bar)
        if config.max_minutes is not None and time.monotonic() - start > 60 * config.max_minutes:
            stopped = True
            break
    _evaluate(run, len(losses), bar)
    bar.close()
    save_checkpoint(run.model, config, run.out, len(losses))
    return TrainResult(losses, len(losses), run.out, stopped)


_TRAIN_FLAGS = MappingProxyType({
    "steps": "optimizer steps (the cosine schedule spans them)",
    "batch_size": "sequences (examples) per step",
    "seq_len": "longest sequence; longer examples lose distractor documents until they fit",
    "lr": "peak learning rate of AdamW",
    "min_lr_ratio": "final learning rate as a fraction of the peak",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay (not applied to norms and biases)",
    "grad_clip": "gradient norm clip (0 disables)",
    "answer_weight": "extra weight of the answer tokens' mean loss (0: plain LM loss)",
    "extra_questions": "append up to N of an example's extra_questions (generated with "
                       "--extra-questions) after its answer: more answers per token",
    "extra_kind": "which extra questions to append: any, or only single_hop",
    "copy_rows": "add N rows per batch of a random token run and its repeat (loss on the "
                 "repeat counts as answer): drills the copy circuit answers need",
    "copy_length": "length of the random run in a copy-drill row",
    "eval_every": "every N steps, log the validation split's greedy answer accuracy per "
                  "question kind (0: only at the end; validation.jsonl of --data)",
    "eval_examples": "validation examples scored (0: none)",
    "workers": "processes that encode the training set",
    "memory_heads": "per linear layer, the first N value heads get a fixed decay of --memory-decay per token, "
                    "whatever the input (memory on the scale of a document; kept fixed in training)",
    "memory_decay": "per-token log decay of the --memory-heads heads",
    "seed": "seed of initialisation and data order",
    "save_every": "save a checkpoint-NNNNNN directory every N steps (0: only at the end)",
    "keep_checkpoints": "how many periodic checkpoints to keep",
})


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options (model shape flags override ``ModelConfig`` defaults)."""
    defaults = TrainConfig(Path(), Path(), Path())
    parser = argparse.ArgumentParser(
        prog="python -m hypic_data.train",
        description="Train a small Qwen3.5-architecture hybrid model (3 linear-attention "
                    "layers : 1 full-attention layer) on the synthetic QA train split. Saves "
                    "save_pretrained checkpoints with tokenizer.json beside them; the final "
                    "model goes to --out itself. Runs on CPU (slowly) or CUDA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("datasets/synthetic_qa"),
                        help="dataset directory holding train.jsonl")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="tokenizer.json or a directory holding it")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    for name, text in _TRAIN_FLAGS.items():
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                            help=text)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--kernel", choices=("auto", "torch"), default="auto",
                        help="gated delta rule of the linear layers: auto = FLA's Triton kernel "
                             "on CUDA when installed, else our chunked PyTorch form; torch = ours")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="wall-clock budget; training stops and saves when it is spent")
    parser.add_argument("--schedule-minutes", type=float, default=None,
                        help="fit the step count (at most --steps) so that the learning-rate "
                             "schedule ends after this much training, timed over steps "
                             f"{PROBE_STEPS[0]}-{PROBE_STEPS[1]}")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="use only the first N training examples")
    parser.add_argument("--transformers-dt-init", dest="long_memory_init", action="store_false",
                        help="keep transformers' dt_bias = 1 (short-memory linear layers; how "
                             "the shipped default model was trained) instead of the Mamba-2 / "
                             "FLA long-memory initialisation")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from the weights of this checkpoint directory "
                             "(staged training: short sequences first, then longer ones)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch CPU threads; 1 is far faster on a busy 2-core machine")
    _add_model_args(parser)
    return parser.parse_args(argv)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags for the model's shape (linear value heads are always 2 x key heads)."""
    model = ModelConfig()
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(model, name), help="model shape")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A ``TrainConfig`` from parsed command-line options."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "progress"}
    values = vars(args)
    model = ModelConfig(**{k: v for k, v in values.items() if k in model_fields})
    return TrainConfig(**{k: v for k, v in values.items() if k in train_fields},
                       progress=not args.no_progress, model=model)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command line."""
    args = _parse_args(argv)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    result = train(config_from_args(args))
    note = " (stopped by --max-minutes)" if result.stopped_early else ""
    print(f"trained {result.steps} steps{note}; final loss {result.losses[-1]:.4f}; "
          f"model saved to {result.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
