"""`localspec train-eagle`: train an EAGLE head for a target on this machine (CPU or GPU).

No hub is reachable from many machines, so this is how a target gets a head: the target itself
supplies everything. Data is local text/code files (by default the Python standard library's
source, present wherever Python is) and/or the target's own greedy answers to prompts built from
that source (`--self-distill N`; what the head will meet in a chat). Per sequence one target pass
records the features the head reads and the target's final hidden state (whose logits over the
draft vocabulary are the training signal).

Training follows EAGLE-3's recipe at CPU scale: the draft vocabulary is the most frequent target
tokens (d2t offsets), the head's lm_head and norm start from the target's own, and each batch is
unrolled for `ttt_steps` "training-time test" steps, where step j feeds the head its own outputs of
step j-1 (as when drafting) and learns the target's distribution j+1 tokens further on; losses are
weighted 0.8^j. Everything is resumable: generated answers, the recorded features and the
optimizer state are saved in the output folder as they are made.
"""

from __future__ import annotations

import ast
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from localspec.base.errors import LocalspecError
from localspec.base.files import write_text_atomic
from localspec.core.prompt import chat_ids
from localspec.core.proposers.eagle import FeatureTap
from localspec.core.proposers.eagle_head import EagleHead, HeadConfig, load_weights_only, save_head
from localspec.runtime.quant import dense_weight

PROMPT_CONTEXT = 32
"""Prompt positions kept before a self-distilled answer for training."""
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java"}


@dataclass
class TrainSettings:
    version: int = 3
    seq_len: int = 256
    max_tokens: int = 60_000
    """Training tokens from files (self-distilled answers come on top)."""
    self_distill: int = 0
    answer_tokens: int = 160
    draft_vocab: int = 8192
    intermediate_size: int | None = None
    epochs: int = 4
    batch: int = 4
    lr: float = 1e-3
    ttt_steps: int = 3
    seed: int = 0


# -- data -------------------------------------------------------------------------------------


def default_sources() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def iter_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()
                         and "test" not in p.parts and "site-packages" not in p.parts)
        elif path.is_file():
            files.append(path)
        else:
            raise LocalspecError(f"--data {path}: no such file or folder")
    return files


def file_sequences(tokenizer, paths: list[Path], settings: TrainSettings, rng: random.Random) -> list[list[int]]:
    """Token sequences of seq_len from the files, shuffled by file, until max_tokens."""
    files = iter_files(paths)
    rng.shuffle(files)
    sequences, total = [], 0
    for path in files:
        if total >= settings.max_tokens:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - settings.seq_len // 2, settings.seq_len):
            chunk = ids[start : start + settings.seq_len]
            sequences.append(chunk)
            total += len(chunk)
            if total >= settings.max_tokens:
                break
    return sequences


def code_prompts(paths: list[Path], count: int, rng: random.Random) -> list[str]:
    """Chat prompts made from the functions found in the sources: tasks phrased from their
    docstrings (free-form questions, like a user's), and requests about their code."""
    functions = []
    for path in iter_files(paths):
        if path.suffix != ".py" or len(functions) > 20 * count:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                code = ast.get_source_segment(source, node) or ""
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0].rstrip(".")
                if 3 <= code.count("\n") <= 30 and len(doc.split()) >= 3:
                    functions.append((path.stem, node.name, _imperative(doc), code))
    if not functions:
        raise LocalspecError("no documented Python functions found in the data to build prompts from")
    rng.shuffle(functions)
    templates = [
        lambda m, n, d, c: f"Write a Python function that does this: {d}.",
        lambda m, n, d, c: f"How would you {d} in Python? Show the code.",
        lambda m, n, d, c: f"Explain what `{n}` in Python's `{m}` module is for, with a short example.",
        lambda m, n, d, c: f"Explain what this Python function does:\n```python\n{c}\n```",
        lambda m, n, d, c: f"Write a Python function `{n}` ({d}) and explain it briefly.",
        lambda m, n, d, c: f"Refactor this code to be clearer and add type hints:\n```python\n{c}\n```",
    ]
    return [templates[i % len(templates)](*functions[i % len(functions)]) for i in range(count)]


def _imperative(doc: str) -> str:
    """"Returns the size." -> "return the size": docstrings describe, prompts ask."""
    first, _, rest = doc.partition(" ")
    word = first.lower()
    if word.endswith("ies"):
        word = word[:-3] + "y"
    elif word.endswith(("ches", "shes", "sses", "xes")):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    return f"{word} {rest}".strip()


ANSWER_BATCH = 32
"""Answers generated together: on a CPU, 32 answers of smollm2-135m took half the time in one batch
that they took in batches of 8 (the step's fixed cost is paid once for more rows)."""


def answer_batch(target, width: int, device: torch.device) -> int:
    """ANSWER_BATCH, or fewer where their caches (every layer's keys and values over `width`
    positions, float32) would take more than a quarter of the free memory."""
    from localspec.store.machine import free_memory

    config = target.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_answer = config.num_hidden_layers * 2 * heads * head_dim * 4 * width
    return max(1, min(ANSWER_BATCH, free_memory(device) // 4 // max(per_answer, 1)))


@torch.inference_mode()
def self_distilled(target, tokenizer, prompts: list[str], settings: TrainSettings, store: Path, progress) -> list[tuple[list[int], int]]:
    """(prompt + the target's own greedy answer, prompt length) per prompt; answers already in
    `store` are reused."""
    done: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    if store.exists():
        for line in store.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            done[record["prompt"]] = record["ids"]
            lengths[record["prompt"]] = record.get("prompt_len", 0)
    todo = [p for p in prompts if p not in done]
    device = next(target.parameters()).device
    batch = answer_batch(target, max((len(chat_ids(tokenizer, p)) for p in todo), default=0) + settings.answer_tokens, device)
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="target answers", unit="answer")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with store.open("a", encoding="utf-8") as out:
        for i in range(0, len(todo), batch):
            group = todo[i : i + batch]
            encoded = [chat_ids(tokenizer, p) for p in group]
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)  # left-padded
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
            generated = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=settings.answer_tokens, pad_token_id=pad)
            for prompt, e, row in zip(group, encoded, generated[:, width:].tolist()):
                answer = row[: row.index(pad)] if pad in row else row
                done[prompt] = e + answer
                lengths[prompt] = len(e)
                out.write(json.dumps({"prompt": prompt, "ids": done[prompt], "prompt_len": len(e)}) + "\n")
                out.flush()
            bar.update(len(group))
    bar.close()
    return [(done[p], lengths[p]) for p in prompts]


@torch.inference_mode()
def record_features(target, cfg: HeadConfig, sequences: list[tuple[list[int], int]], progress) -> list[dict]:
    """One target pass per (ids, loss start): features the head reads, the final hidden state, and
    which positions count (a prompt only conditions; the head learns the answers)."""
    tap = FeatureTap(target, cfg.aux_layers)
    final = FeatureTap(target, ()) if cfg.aux_layers else None
    device = next(target.parameters()).device
    records = []
    try:
        for ids, loss_start in progress(sequences, desc="target features", unit="seq"):
            x = torch.tensor([ids], device=device)
            target.model(input_ids=x) if hasattr(target, "model") else target(x)
            feats = tap.take()
            last = final.take() if final is not None else feats
            # the features already carry the whole prompt; training on its last few positions is
            # enough context for the head's own attention, and much cheaper than all of them
            start = max(0, loss_start - PROMPT_CONTEXT)
            valid = torch.arange(start, len(ids)) >= loss_start
            records.append({"ids": torch.tensor(ids[start:]), "valid": valid, "features": feats[start:].to(torch.bfloat16).cpu(),
                            "final": last[start:].to(torch.bfloat16).cpu()})
    finally:
        tap.remove()
        if final is not None:
            final.remove()
    return records


def draft_vocabulary(sequences: list[list[int]], vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target ids, ascending (EAGLE-3's `used`); target = i + d2t[i]."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)[:vocab]  # an answer may be empty
    size = min(size, vocab)
    return torch.topk(counts, size).indices.sort().values


# -- training ---------------------------------------------------------------------------------


def ttt_loss(head: EagleHead, batch: dict, target_head: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """Training-time test over a batch: (weighted loss, step-0 top-1 agreement with the target).

    Position t reads (feature_t, token t+1); step j predicts token t+2+j, whose target
    distribution comes from the final hidden state at t+1+j. Step j's queries see step 0's keys
    causally and their own position's keys of steps 1..j (what drafting j tokens ahead sees).
    """
    ids, feats, final, valid = batch["ids"], batch["features"], batch["final"], batch["valid"]  # (B, L), (B, L, F), (B, L, H), (B, L)
    b, length = ids.shape
    n = length - 1
    positions = torch.arange(n, device=ids.device)[None].expand(b, -1)  # (B, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    diagonal = torch.eye(n, dtype=torch.bool, device=ids.device)
    hidden = feats[:, :-1]  # (B, n, F)
    keys = values = None
    total, weight_sum, agree = 0.0, 0.0, 0.0
    for j in range(steps):
        span = n - j - 1  # positions whose prediction target (t + 2 + j) exists
        if span <= 0:
            break
        tokens = ids[:, 1 + j : 1 + j + n]  # (B, <= n): token t+1+j
        tokens = F.pad(tokens, (0, n - tokens.shape[1]))
        mask = torch.cat([causal] + [diagonal] * j, dim=1)  # (n, n * (j + 1)): step 0 causal, steps 1..j same position
        out, k, v = head(hidden, tokens, positions + j, keys, values, mask[None].expand(b, -1, -1))
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        logits = head.logits(out[:, :span]).float()  # (B, span, Vd)
        with torch.no_grad():
            target_logits = final[:, 1 + j : 1 + j + span].float() @ target_head.T  # (B, span, Vd)
            target_probs = target_logits.softmax(-1)
            ok = valid[:, 2 + j : 2 + j + span].float()  # the predicted token is real, not padding
        loss = -(target_probs * logits.log_softmax(-1)).sum(-1)  # (B, span)
        loss = (loss * ok).sum() / ok.sum().clamp_min(1)
        total = total + (0.8 ** j) * loss
        weight_sum += 0.8 ** j
        if j == 0:
            agree = float(((logits.argmax(-1) == target_logits.argmax(-1)).float() * ok).sum() / ok.sum().clamp_min(1))
        hidden = out  # step j+1 reads this step's output at the same position
    return total / weight_sum, agree


def collate(records: list[dict], head_dtype: torch.dtype, device) -> dict:
    length = max(len(r["ids"]) for r in records)
    def pad(t, fill=0):
        return F.pad(t, (0, 0, 0, length - t.shape[0])) if t.dim() == 2 else F.pad(t, (0, length - t.shape[0]), value=fill)
    return {
        "ids": torch.stack([pad(r["ids"]) for r in records]).to(device),
        "features": torch.stack([pad(r["features"]) for r in records]).to(device, head_dtype),
        "final": torch.stack([pad(r["final"]) for r in records]).to(device, torch.float32),
        "valid": torch.stack([pad(r["valid"].to(torch.uint8)) for r in records]).bool().to(device),
    }


_RECORD_KEYS = {"ids", "valid", "features", "final"}


def load_resume_file(path: Path, keys: tuple[str, ...]) -> dict:
    """A resume file, read as `load_weights_only` reads it (a planted file cannot run code)."""
    stored = load_weights_only(path, "localspec training state", "delete it to redo that step")
    if not isinstance(stored, dict) or not set(keys) <= stored.keys():
        raise LocalspecError(f"{path} is not localspec training state (expected {', '.join(keys)}); delete it to redo that step")
    return stored


def train_eagle(target_loaded, out_dir: Path, data: list[Path] | None, settings: TrainSettings, quiet: bool = False) -> dict:
    """Train (or resume training) a head for the loaded target; writes it to out_dir in the
    official layout and returns a summary."""
    from tqdm import tqdm

    def progress(iterable=None, **kw):
        return tqdm(iterable, disable=quiet, file=sys.stderr, dynamic_ncols=True, **kw)

    target, tokenizer = target_loaded.model, target_loaded.tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    settings_file = out_dir / "train_settings.json"
    if settings_file.exists():
        try:
            saved = json.loads(settings_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LocalspecError(f"{settings_file} cannot be read ({exc}); use another --out") from exc
        # more epochs continue a run; anything else would mix two different runs
        if not isinstance(saved, dict) or {**saved, "epochs": settings.epochs} != asdict(settings):
            raise LocalspecError(f"{out_dir} holds a training run with other settings ({settings_file}); use another --out")
    write_text_atomic(settings_file, json.dumps(asdict(settings), indent=1) + "\n")  # never half a file to resume from
    sources = data or default_sources()

    data_file = out_dir / "train_data.pt"
    if data_file.exists():
        stored = load_resume_file(data_file, ("records", "used"))
        records, used = stored["records"], stored["used"]
        if not (isinstance(records, list) and all(isinstance(r, dict) and _RECORD_KEYS <= r.keys() for r in records)
                and isinstance(used, torch.Tensor)):
            raise LocalspecError(f"{data_file} does not hold recorded features; delete it to record them again")
    else:
        sequences = [(ids, 0) for ids in file_sequences(tokenizer, sources, settings, rng)] if settings.max_tokens else []
        if settings.self_distill:
            prompts = code_prompts(sources, settings.self_distill, rng)
            sequences += self_distilled(target, tokenizer, prompts, settings, out_dir / "answers.jsonl", progress)
        if not sequences:
            raise LocalspecError("no training data: give --data files or --self-distill N")
        cfg0 = HeadConfig.for_target(target.config, settings.version, settings.draft_vocab, settings.intermediate_size)
        records = record_features(target, cfg0, sequences, progress)
        used = draft_vocabulary([ids[start:] for ids, start in sequences], cfg0.vocab_size, settings.draft_vocab)
        torch.save({"records": records, "used": used}, data_file)

    cfg = HeadConfig.for_target(target.config, settings.version, len(used), settings.intermediate_size)
    full_head = dense_weight(target.get_output_embeddings()).float()  # (V, H), whatever format the target runs
    head = EagleHead(cfg, dense_weight(target.get_input_embeddings()).float(), full_head if cfg.version == 1 else None)
    if cfg.version == 3:
        with torch.no_grad():  # start from the target's own output layer and final norm
            head.d2t.copy_(used - torch.arange(len(used)))
            head.lm_head.weight.copy_(full_head[used])
            norm = getattr(target.get_decoder(), "norm", None)
            if norm is not None:
                head.norm.weight.copy_(norm.weight.float())
    target_head = full_head[used] if cfg.version == 3 else full_head  # (Vd, H): target logits over the draft vocabulary
    head.train()

    held_out = max(1, len(records) // 20)
    rng.shuffle(records)
    evaluation, training = records[:held_out], records[held_out:]
    steps_per_epoch = math.ceil(len(training) / settings.batch)
    total_steps = steps_per_epoch * settings.epochs
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, min(100, total_steps // 10))
    step = 0
    state_file = out_dir / "train_state.pt"
    if state_file.exists():
        state = load_resume_file(state_file, ("head", "optimizer", "step"))
        try:
            head.load_state_dict(state["head"])
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise LocalspecError(f"{state_file} does not fit this head ({exc}); delete it to train from the start") from exc
    # made after a resume, at its step: the schedule spans the epochs asked for now (the optimizer's
    # saved groups carry the initial learning rate it starts from)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
        last_epoch=step - 1,
    )
    device = next(target.parameters()).device
    head.to(device)
    target_head = target_head.to(device)
    started = time.perf_counter()
    bar = progress(total=total_steps, initial=step, desc="training head", unit="step")
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)
        order = list(range(len(training)))
        random.Random(settings.seed + epoch).shuffle(order)  # the same order after a resume
        chunk = [training[i] for i in order[index * settings.batch : (index + 1) * settings.batch]]
        loss, agree = ttt_loss(head, collate(chunk, torch.float32, device), target_head, settings.ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        schedule.step()
        step += 1
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree:.0%}")
        bar.update(1)
        if step % 50 == 0 or step == total_steps:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step}, state_file.with_suffix(".partial"))
            state_file.with_suffix(".partial").replace(state_file)
    bar.close()
    head.eval()
    with torch.no_grad():
        agreement = [ttt_loss(head, collate([r], torch.float32, device), target_head, 1)[1] for r in evaluation]
    summary = {
        "target": target_loaded.name, "version": cfg.version, "training_sequences": len(training),
        "training_tokens": int(sum(int(r["valid"].sum()) for r in training)), "steps": total_steps, "epochs": settings.epochs,
        "ttt_steps": settings.ttt_steps, "draft_vocab": len(used), "held_out_top1": round(sum(agreement) / len(agreement), 3),
        "train_seconds_this_run": round(time.perf_counter() - started, 1), "target_weights": str(target_loaded.quant),
    }
    save_head(head.cpu(), out_dir, extras=summary)
    return summary

