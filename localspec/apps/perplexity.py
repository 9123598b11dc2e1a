"""Quality measured as the peers measure it: `localspec bench --perplexity TEXT`.

llama-perplexity's method: the text is tokenized whole and cut into chunks of `context` tokens
(at most `chunks` of them); each chunk is one forward pass from an empty cache (its first token
replaced by BOS where the model adds one), and only the second half is scored: the mean negative
log-likelihood of tokens context/2 + 1 ... context - 1, each from the logits before it.

Each weight format asked for is measured on the same tokens, beside the float32 model
de-quantized from the same file (the gguf package's de-quantizer: the file's model with nothing
else rounded), which also gives each format's mean KL divergence from it and how often their top
tokens agree. With `--llama-cpp DIR` llama.cpp's own `llama-perplexity` runs on the same GGUF and
text with the same context and chunk count, and the report gives localspec's perplexity over it.
The passes run outside `prompt_pass`: these are the numbers decoding and verification compute.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from localspec.base.errors import LocalspecError
from localspec.store.loading import load_model, release_memory
from localspec.store.registry import ModelEntry

_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+)")


@dataclass
class Scored:
    nll: torch.Tensor  # (positions,) float64: -log p(token)
    log_probs: torch.Tensor  # (positions, V) float32 of the predicting rows, for the KL
    top: torch.Tensor  # (positions,) argmax

    @property
    def perplexity(self) -> float:
        return float(torch.exp(self.nll.mean()))


def chunk_tokens(tokenizer, text: str, context: int, chunks: int) -> list[list[int]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = min(len(ids) // context, chunks)
    if count < 1:
        raise LocalspecError(f"the text has {len(ids)} tokens: perplexity needs at least one chunk of {context}")
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    out = [ids[i * context : (i + 1) * context] for i in range(count)]
    if bos is not None:
        out = [[bos] + chunk[1:] for chunk in out]
    return out


def score(model: torch.nn.Module, chunks: list[list[int]], keep_log_probs: bool = True) -> Scored:
    """The second half of every chunk, one pass per chunk from an empty cache."""
    nll, log_probs, top = [], [], []
    for chunk in chunks:
        first = len(chunk) // 2
        with torch.no_grad():
            logits = model(torch.tensor([chunk]), use_cache=False).logits[0, first:-1].float()  # (T/2 - 1, V)
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(chunk[first + 1 :])
        nll.append(-lp.gather(1, targets[:, None])[:, 0].double())
        top.append(lp.argmax(-1))
        if keep_log_probs:
            log_probs.append(lp)
    return Scored(torch.cat(nll), torch.cat(log_probs) if keep_log_probs else torch.empty(0), torch.cat(top))


def compare(scored: Scored, reference: Scored) -> dict:
    """KL(reference || scored) per position, averaged, and the top-1 agreement."""
    kl = (reference.log_probs.exp() * (reference.log_probs - scored.log_probs)).sum(-1)
    return {"mean_kl_vs_float32": float(kl.mean()), "top1_agreement_vs_float32": float((scored.top == reference.top).float().mean())}


def perplexity_report(entry: ModelEntry, text_file: Path, quants: list[str], context: int = 512, chunks: int = 4,
                      llama_cpp: str | None = None, threads: int | None = None) -> dict:
    from localspec.store.tokenizers import gguf_file

    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LocalspecError(f"--perplexity {text_file}: {exc}") from None
    if context < 4 or chunks < 1:
        raise LocalspecError("--context must be at least 4 and --chunks at least 1")
    gguf = gguf_file(entry)
    report: dict = {"model": entry.name, "gguf": str(gguf), "text": str(text_file), "context": context, "formats": {}}
    reference = None
    for quant in ["none"] + [q for q in quants if q != "none"]:
        start = time.perf_counter()
        loaded = load_model(entry, torch.float32, quant=quant, progress=True)
        if reference is None:
            token_chunks = chunk_tokens(loaded.tokenizer, text, context, chunks)
            report["chunks"], report["scored_tokens"] = len(token_chunks), len(token_chunks) * (context - context // 2 - 1)
        scored = score(loaded.model, token_chunks)
        label = "float32" if quant == "none" else quant
        figures = {"perplexity": scored.perplexity, "seconds": round(time.perf_counter() - start, 1)}
        if reference is None:
            reference = scored
        else:
            figures.update(compare(scored, reference))
        report["formats"][label] = figures
        print(f"  {label:10} perplexity {scored.perplexity:.4f}", file=sys.stderr, flush=True)
        del loaded
        release_memory()
    if llama_cpp:
        report["llama_cpp"] = llama_perplexity(llama_cpp, gguf, text_file, context, len(token_chunks), threads)
        for figures in report["formats"].values():
            figures["vs_llama_cpp"] = figures["perplexity"] / report["llama_cpp"]["perplexity"]
    return report


def llama_perplexity(folder: str, gguf: Path, text_file: Path, context: int, chunks: int, threads: int | None) -> dict:
    from localspec.apps.llamacpp import measured_run

    tool = shutil.which("llama-perplexity", path=str(Path(folder).expanduser()))  # llama-perplexity.exe on Windows
    if tool is None:
        raise LocalspecError(f"--llama-cpp {folder}: no llama-perplexity there (build llama.cpp's llama-perplexity target)")
    cmd = [tool, "-m", str(gguf), "-f", str(text_file), "-c", str(context), "--chunks", str(chunks)]
    if threads:
        cmd += ["-t", str(threads)]
    run = measured_run(cmd, "llama-perplexity")
    match = _FINAL.search(run.stderr + run.stdout)
    if match is None:
        raise LocalspecError("cannot read the final estimate from llama-perplexity's output")
    return {"perplexity": float(match.group(1)), "seconds": round(run.seconds, 1), "peak_rss_mb": run.peak_rss_mb}


def print_report(report: dict) -> None:
    llama = report.get("llama_cpp")
    print(f"perplexity of {report['model']} on {report['text']} ({report['chunks']} x {report['context']} tokens, "
          f"{report['scored_tokens']} scored)")
    if llama:
        print(f"  {'llama.cpp':10} {llama['perplexity']:.4f}")
    for label, f in report["formats"].items():
        extra = f"  KL {f['mean_kl_vs_float32']:.4f}, top-1 agreement {f['top1_agreement_vs_float32']:.1%}" if "mean_kl_vs_float32" in f else ""
        ratio = f"  {f['vs_llama_cpp']:.4f}x llama.cpp" if "vs_llama_cpp" in f else ""
        print(f"  {label:10} {f['perplexity']:.4f}{ratio}{extra}")


def run_perplexity(args, entry: ModelEntry) -> int:
    from localspec.store.loading import pick_device
    from localspec.store.session import choose_quant

    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    quants = [choose_quant(entry, "auto", pick_device())[0] if q == "auto" else q for q in quants or ["auto"]]
    report = perplexity_report(entry, Path(args.perplexity), quants, args.context, args.chunks, args.llama_cpp,
                               torch.get_num_threads())
    print_report(report)
    from localspec.apps.bench import write_report

    write_report(report, args.out, f"perplexity-{entry.name}")
    return 0
