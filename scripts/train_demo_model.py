"""Train the bundled demo model: a small Llama-architecture checkpoint.

The corpus is English text that ships with CPython itself, so training needs
nothing beyond a standard Python installation (PSF license):

* ``pydoc_data.topics.topics``: the language-reference topics that ``help()``
  shows (``help("with")``, ``help("LISTS")``, ...), split on blank lines into
  documents of a few paragraphs each;
* docstrings (``inspect.getdoc``) of a fixed, sorted list of standard-library
  modules and of their public classes, methods and functions. About one in five
  of the object docstrings is rendered through the chat template as an answer to
  a question about the object, so the chat format is not foreign to the model.

Every document is wrapped as ``<|bos|> text <|eos|>`` and documents are packed
back to back into fixed-length training sequences, so the model learns to end
its output by itself at natural, varied lengths.

The corpus, the 95/5 split of sources into training and validation and the
tokenizer are deterministic for a given Python version (sorted inputs, seeded
hashes). Training runs on CPU with fixed seeds and a bounded wall time; unless
``--steps`` is given, the learning-rate schedule follows the wall clock, so
the weights also depend on how many steps fit in ``--max-minutes``.

Retrain (see ``docs/demo-model.md``)::

    .venv/bin/python scripts/train_demo_model.py --out models/demo --threads 1 --max-minutes 25 --seed 0

Re-print the evaluation figures of an existing checkpoint::

    .venv/bin/python scripts/train_demo_model.py --out models/demo --eval-only
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import random
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2

# Rendered with jinja2 (the serving engine and transformers both do this). The
# BOS token is part of the template, so a rendered prompt is tokenized without
# adding special tokens again.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Standard-library modules whose docstrings join the corpus: a fixed, sorted
# list of modules present on every POSIX CPython >= 3.10 and not deprecated.
STDLIB_MODULES = sorted(
    [
        "abc",
        "argparse",
        "array",
        "ast",
        "asyncio",
        "asyncio.events",
        "asyncio.futures",
        "asyncio.locks",
        "asyncio.queues",
        "asyncio.streams",
        "asyncio.subprocess",
        "asyncio.tasks",
        "base64",
        "bdb",
        "binascii",
        "bisect",
        "builtins",
        "bz2",
        "calendar",
        "cmath",
        "cmd",
        "code",
        "codecs",
        "codeop",
        "collections",
        "collections.abc",
        "colorsys",
        "compileall",
        "concurrent.futures",
        "configparser",
        "contextlib",
        "contextvars",
        "copy",
        "copyreg",
        "csv",
        "ctypes",
        "dataclasses",
        "datetime",
        "dbm",
        "decimal",
        "difflib",
        "dis",
        "doctest",
        "email",
        "email.message",
        "email.parser",
        "email.utils",
        "enum",
        "errno",
        "faulthandler",
        "filecmp",
        "fileinput",
        "fnmatch",
        "fractions",
        "ftplib",
        "functools",
        "gc",
        "getopt",
        "getpass",
        "gettext",
        "glob",
        "graphlib",
        "gzip",
        "hashlib",
        "heapq",
        "hmac",
        "html",
        "html.parser",
        "http",
        "http.client",
        "http.cookies",
        "http.server",
        "imaplib",
        "importlib",
        "importlib.abc",
        "importlib.machinery",
        "importlib.util",
        "inspect",
        "io",
        "ipaddress",
        "itertools",
        "json",
        "json.decoder",
        "json.encoder",
        "keyword",
        "linecache",
        "locale",
        "logging",
        "logging.handlers",
        "lzma",
        "mailbox",
        "marshal",
        "math",
        "mimetypes",
        "mmap",
        "modulefinder",
        "multiprocessing",
        "multiprocessing.pool",
        "netrc",
        "numbers",
        "opcode",
        "operator",
        "optparse",
        "os",
        "os.path",
        "pathlib",
        "pdb",
        "pickle",
        "pickletools",
        "pkgutil",
        "platform",
        "plistlib",
        "poplib",
        "pprint",
        "profile",
        "pstats",
        "pty",
        "py_compile",
        "pyclbr",
        "queue",
        "quopri",
        "random",
        "re",
        "reprlib",
        "runpy",
        "sched",
        "secrets",
        "select",
        "selectors",
        "shelve",
        "shlex",
        "shutil",
        "signal",
        "site",
        "smtplib",
        "socket",
        "socketserver",
        "sqlite3",
        "ssl",
        "stat",
        "statistics",
        "string",
        "stringprep",
        "struct",
        "subprocess",
        "symtable",
        "sys",
        "sysconfig",
        "tabnanny",
        "tarfile",
        "tempfile",
        "textwrap",
        "threading",
        "time",
        "timeit",
        "token",
        "tokenize",
        "trace",
        "traceback",
        "tracemalloc",
        "types",
        "typing",
        "unicodedata",
        "unittest",
        "unittest.mock",
        "urllib.error",
        "urllib.parse",
        "urllib.request",
        "uuid",
        "warnings",
        "wave",
        "weakref",
        "wsgiref.simple_server",
        "xml.dom.minidom",
        "xml.etree.ElementTree",
        "xml.sax",
        "xmlrpc.client",
        "zipapp",
        "zipfile",
        "zlib",
    ]
)

# Training-time settings that are not exposed as flags.
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
MODEL_MAX_LENGTH = 2048
CHUNK_CHARS = 700  # target upper size of a document cut from a long text
MIN_DOC_CHARS = 40
CHAT_EVERY = 5  # one object docstring in CHAT_EVERY becomes a chat exchange
EVAL_PROMPTS = [
    "The list type",
    "A decorator is",
    "To open a file",
    "The with statement",
    "Return a new dictionary",
]
CHAT_QUESTION = "What does json.dumps do?"


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def _normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def split_paragraphs(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` on blank lines into chunks of whole paragraphs.

    A chunk is closed once adding the next paragraph would take it past
    ``limit`` characters; a single paragraph longer than that stays whole.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        if current and size + len(para) > limit:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def chat_text(question: str, answer: str) -> str:
    """A one-turn exchange exactly as ``CHAT_TEMPLATE`` renders it, less the BOS token."""
    return f"<|user|>\n{question}\n<|assistant|>\n{answer}\n"


def check_chat_text() -> None:
    """``chat_text`` must agree with the chat template the checkpoint ships."""
    import jinja2

    messages = [
        {"role": "user", "content": "What does x do?"},
        {"role": "assistant", "content": "It does y."},
    ]
    rendered = (
        jinja2.Environment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, add_generation_prompt=False, bos_token=BOS)
    )
    assert rendered == BOS + chat_text("What does x do?", "It does y."), rendered


def _owned_by(obj: object, modname: str) -> bool:
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return False
    leaf = modname.rsplit(".", 1)[-1]
    return (
        owner == modname
        or owner in ("_" + leaf, "_" + modname)
        or (modname == "os" and owner == "posix")
    )


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _signature(obj: object) -> str:
    """The call signature, with default values that are not plain literals elided.

    Reprs of other objects carry memory addresses or hash-ordered contents,
    which would make the corpus differ from run to run.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = []
    for param in sig.parameters.values():
        default = param.default
        if default is not param.empty and not (
            isinstance(default, (bool, int, float, str, bytes, type(None)))
            and len(repr(default)) <= 40
        ):
            param = param.replace(default=_Elided())
        params.append(param.replace(annotation=param.empty))
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) for the modules in ``STDLIB_MODULES``."""
    out: list[tuple[str, str]] = []
    for modname in STDLIB_MODULES:
        try:
            with (
                warnings.catch_warnings(),
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                warnings.simplefilter("ignore")
                module = importlib.import_module(modname)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            out.append((modname, doc))
        for name in sorted(vars(module)):
            if name.startswith("_"):
                continue
            obj = vars(module)[name]
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _owned_by(obj, modname):
                continue
            qual = f"{modname}.{name}" if modname != "builtins" else name
            doc = inspect.getdoc(obj)
            if doc:
                out.append((qual + _signature(obj) if inspect.isroutine(obj) else qual, doc))
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    if attr.startswith("_"):
                        continue
                    member = vars(obj)[attr]
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if not inspect.isroutine(member):
                        continue
                    doc = inspect.getdoc(member)
                    if doc:
                        out.append((f"{qual}.{attr}" + _signature(member), doc))
    return out


def _bucket(key: str, buckets: int) -> int:
    """A stable pseudo-random bucket for ``key`` (independent of hash seeds)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % buckets


def build_sources() -> list[tuple[str, list[str]]]:
    """All source texts as (key, documents), in a deterministic order.

    Call this in a fresh interpreter (see ``load_sources``): importing other
    libraries can add methods to standard-library classes.
    """
    from pydoc_data.topics import topics

    sources: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for key in sorted(topics):
        text = _normalize(topics[key])
        if text in seen or len(text) < MIN_DOC_CHARS:
            continue
        seen.add(text)
        sources.append((f"topic:{key}", split_paragraphs(text)))

    for name, doc in stdlib_docstrings():
        doc = _normalize(doc)
        if doc in seen or len(doc) < MIN_DOC_CHARS:
            continue
        seen.add(doc)
        short = name.split("(", 1)[0]
        if _bucket(f"chat:{short}", CHAT_EVERY) == 0:
            answer = split_paragraphs(doc)[0]
            sources.append((f"chat:{short}", [chat_text(f"What does {short} do?", answer)]))
        else:
            sources.append((f"doc:{short}", split_paragraphs(f"{name}\n\n{doc}")))
    return sources


def load_sources() -> list[tuple[str, list[str]]]:
    """``build_sources`` run in an isolated interpreter with only the standard library.

    The corpus then depends on the Python version alone, not on what this
    process has imported (torch, transformers, ...).
    """
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--dump-corpus"],
        capture_output=True,
        check=True,
    )
    return [(key, docs) for key, docs in json.loads(proc.stdout.decode("utf-8"))]


def split_sources(sources: list[tuple[str, list[str]]], seed: int, val_percent: int = 5):
    """Hold out whole sources (every chunk of a topic or docstring together)."""
    train: list[str] = []
    val: list[str] = []
    for key, docs in sources:
        (val if _bucket(f"{seed}:{key}", 100) < val_percent else train).extend(docs)
    return train, val


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def write_tokenizer_files(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------


def make_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **MODEL_SHAPE,
    )
    return LlamaForCausalLM(config)


def encode_docs(tok, docs: list[str]) -> list[list[int]]:
    eos_id = tok.token_to_id(EOS)
    # The post-processor prepends BOS; EOS closes every document.
    return [enc.ids + [eos_id] for enc in tok.encode_batch(docs)]


def packed_batches(docs_ids: list[list[int]], seq_len: int, batch_size: int, seed: int):
    """Endless stream of (batch, seq_len) tensors; documents reshuffled each epoch."""
    import torch

    rng = random.Random(seed)
    epoch = 0
    while True:
        order = list(range(len(docs_ids)))
        rng.shuffle(order)
        stream = torch.tensor([t for i in order for t in docs_ids[i]], dtype=torch.long)
        n_seq = len(stream) // seq_len
        seqs = stream[: n_seq * seq_len].view(n_seq, seq_len)
        perm = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, n_seq - batch_size + 1, batch_size):
            yield epoch, seqs[perm[start : start + batch_size]]
        epoch += 1


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps times a cosine decay over ``progress`` in [0, 1]."""
    cosine = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * min(1.0, (step + 1) / warmup) * cosine


def evaluate_loss(model, docs_ids: list[list[int]], seq_len: int, batch_size: int = 8) -> float:
    """Mean next-token loss over ``docs_ids`` packed into ``seq_len`` windows."""
    import torch

    model.eval()
    stream = torch.tensor([t for d in docs_ids for t in d], dtype=torch.long)
    n_seq = len(stream) // seq_len
    seqs = stream[: n_seq * seq_len].view(n_seq, seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n_seq, batch_size):
            batch = seqs[start : start + batch_size]
            loss = model(input_ids=batch, labels=batch).loss
            n = batch.numel() - batch.shape[0]
            total += loss.item() * n
            count += n
    model.train()
    return total / max(1, count)


def train(args, out: Path) -> None:
    import torch

    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    check_chat_text()
    sources = load_sources()
    train_docs, val_docs = split_sources(sources, args.seed)
    n_chars = sum(len(d) for d in train_docs) + sum(len(d) for d in val_docs)
    print(
        f"corpus: {len(sources)} sources, {len(train_docs)} train docs, "
        f"{len(val_docs)} validation docs, {n_chars / 1e6:.2f}M characters",
        flush=True,
    )

    tok = train_tokenizer(train_docs, args.vocab_size)
    train_ids = encode_docs(tok, train_docs)
    val_ids = encode_docs(tok, val_docs)
    lengths = sorted(len(d) for d in train_ids)
    n_train_tokens = sum(lengths)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}; train tokens {n_train_tokens}, "
        f"validation tokens {sum(len(d) for d in val_ids)}; doc length p25/p50/p75/p90 "
        f"{_pct(lengths, 25)}/{_pct(lengths, 50)}/{_pct(lengths, 75)}/{_pct(lengths, 90)}",
        flush=True,
    )

    model = make_model(tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # The cosine schedule runs over whichever ends first: --steps, or the
    # wall-time budget less what is kept for saving and evaluation. On an idle
    # machine with --steps set the schedule depends on the step count alone and
    # the run is reproducible; otherwise it follows the clock, so that the
    # learning rate is fully annealed when the budget runs out.
    deadline = t_start + args.max_minutes * 60.0 - args.eval_reserve
    batches = packed_batches(train_ids, args.seq_len, args.batch_size, args.seed)
    model.train()
    t_train = time.time()
    step = 0
    ema = None
    clock_led = False
    while True:
        step_frac = step / args.steps if args.steps else 0.0
        time_frac = (time.time() - t_train) / max(1e-9, deadline - t_train)
        progress = max(step_frac, time_frac)
        if progress >= 1.0:
            break
        if args.steps and step and time_frac > step_frac and not clock_led:
            clock_led = True
            print(f"step {step}: the wall clock now leads the schedule", flush=True)
        lr = lr_at(step, progress, args.lr, args.warmup)
        for group in optim.param_groups:
            group["lr"] = lr
        epoch, batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        step += 1
        if step % args.log_every == 0:
            elapsed = time.time() - t_train
            tps = step * args.batch_size * args.seq_len / elapsed
            print(
                f"step {step} ({100 * progress:.0f}%) epoch {epoch} loss {ema:.3f} lr {lr:.2e} "
                f"{tps:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
        if step % args.eval_every == 0:
            val = evaluate_loss(model, val_ids, args.seq_len)
            print(f"step {step} validation loss {val:.3f} ppl {math.exp(val):.1f}", flush=True)

    train_time = time.time() - t_train
    seen = step * args.batch_size * args.seq_len
    print(
        f"trained {step} steps, {seen / 1e6:.2f}M tokens "
        f"({seen / n_train_tokens:.1f} epochs) in {train_time / 60:.1f} min",
        flush=True,
    )
    save(model, tok, out)
    total_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"saved {out} ({total_mb:.1f} MB on disk)", flush=True)
    run_eval(out, args, val_docs=val_docs)
    print(f"total wall time {(time.time() - t_start) / 60:.1f} min", flush=True)


def save(model, tok, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "chat_template.jinja"):
        (out / stale).unlink(missing_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=128,
    )
    model.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)
    # Older readers expect these keys at the top level of config.json.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "float32"
    config["rope_theta"] = MODEL_SHAPE["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(tok, out)


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


def _pct(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    idx = min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))
    return sorted_values[idx]


def run_eval(out: Path, args, val_docs: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_grad_enabled(False)

    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id

    if val_docs is None:
        _, val_docs = split_sources(load_sources(), args.seed)
    val_ids = [enc + [eos_id] for enc in tokenizer(val_docs)["input_ids"]]
    val = evaluate_loss(model, val_ids, args.seq_len)
    print(f"\nvalidation loss {val:.3f} (perplexity {math.exp(val):.1f})", flush=True)

    def generate(prompts: list[str], seed: int, **kw) -> list[list[int]]:
        torch.manual_seed(seed)
        enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        gen = model.generate(**enc, eos_token_id=eos_id, pad_token_id=pad_id, **kw)
        return [row[enc["input_ids"].shape[1] :].tolist() for row in gen]

    def show(ids: list[int]) -> str:
        ended = eos_id in ids
        if ended:
            ids = ids[: ids.index(eos_id)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return text + (" <|eos|>" if ended else " ...")

    print("\ngreedy completions (up to 60 new tokens):", flush=True)
    greedy = generate(EVAL_PROMPTS, args.seed, do_sample=False, max_new_tokens=60)
    for prompt, ids in zip(EVAL_PROMPTS, greedy, strict=True):
        print(f"--- {prompt!r}\n{prompt}{show(ids)}", flush=True)

    print("\nsampled completions (temperature 0.8, top-p 0.95, up to 80 tokens):", flush=True)
    sampled = generate(
        EVAL_PROMPTS, args.seed, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=80
    )
    for prompt, ids in zip(EVAL_PROMPTS, sampled, strict=True):
        print(f"--- {prompt!r}\n{prompt}{show(ids)}", flush=True)

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    torch.manual_seed(args.seed)
    enc = tokenizer(chat, return_tensors="pt", add_special_tokens=False)
    gen = model.generate(
        **enc,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=80,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    print(f"\nchat (sampled):\n{chat}{show(gen[0, enc['input_ids'].shape[1] :].tolist())}")

    # Output lengths when sampling up to 256 new tokens from held-out document
    # starts: the spread of these lengths is what continuous batching exploits.
    starts = []
    for doc in val_docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= 16:
            starts.append(tokenizer.decode(ids[:8]))
        if len(starts) == args.n_length_prompts:
            break
    lengths, ended = [], 0
    for i in range(0, len(starts), 10):
        for ids in generate(
            starts[i : i + 10],
            args.seed + i,
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            max_new_tokens=256,
        ):
            if eos_id in ids:
                ended += 1
                lengths.append(ids.index(eos_id) + 1)
            else:
                lengths.append(len(ids))
    lengths.sort()
    print(
        f"\noutput lengths over {len(lengths)} held-out prompts (sampling, max 256 new tokens):\n"
        f"  ended with EOS: {ended}/{len(lengths)} ({100 * ended / max(1, len(lengths)):.0f}%)\n"
        f"  min/p25/p50/p75/max: {lengths[0]}/{_pct(lengths, 25)}/{_pct(lengths, 50)}/"
        f"{_pct(lengths, 75)}/{lengths[-1]} tokens\n"
        f"  mean: {sum(lengths) / len(lengths):.1f} tokens",
        flush=True,
    )
    total_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"checkpoint size on disk: {total_mb:.1f} MB", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-minutes", type=float, default=25.0, help="wall-time budget")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default: as many as fit in --max-minutes; the schedule "
        "then follows the wall clock)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument(
        "--eval-reserve",
        type=float,
        default=120.0,
        help="seconds of the budget kept for saving and the final evaluation",
    )
    p.add_argument("--n-length-prompts", type=int, default=50)
    p.add_argument("--eval-only", action="store_true", help="evaluate the checkpoint at --out")
    p.add_argument("--dump-corpus", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.dump_corpus:
        sys.stdout.buffer.write(json.dumps(build_sources()).encode("utf-8"))
        return

    import torch

    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    warnings.filterwarnings("ignore")
    if args.eval_only:
        run_eval(args.out, args)
    else:
        train(args, args.out)


if __name__ == "__main__":
    sys.exit(main())
