"""What both vLLM checks speak: the modes, the seeded prompts, and one typed record per result.

The offline check (:mod:`.check`: an engine per (model, mode) in a worker process of
:mod:`.runner`, every request queued before the first step) and the online check
(:mod:`.online`: a server under concurrent clients) ask the same question in two settings.  They
share, from here:

* **the modes** (:data:`MODES`), one name each, the same on the command lines, in the JSON files
  and in the figures: ``default`` (vLLM as installed), ``invariant`` (``VLLM_BATCH_INVARIANT=1``,
  vLLM's own mode), ``kit`` (``KIT_BATCH_INVARIANT=1``: the kit's plugin) and ``kit+attention``
  (kit mode with the kit's attention backend as well); a kit mode runs with vLLM's own mode under
  it on a GPU, or without it (``--vllm-mode-under-kit``, :data:`VLLM_UNDER_KIT`: the rows name it
  ``<mode> alone``, :func:`label`, :func:`variants`);
* **the prompts** of the kit's random-weight models, each chosen by its seed
  (:data:`TARGET`, :data:`NEEDLE`, :func:`random_prompt`): the same token ids on every machine and
  in both checks;
* **the records**: frozen dataclasses for what a worker or a server returns (:class:`Completion`,
  :class:`TargetsResult`, :class:`Choice`) and one per kind of result row (:data:`ROW_TYPES`,
  :class:`FailedRow`), with :class:`Comparison` (:func:`compare`: one answer against the answer
  alone, bitwise) inside them.  :func:`parse` reads a dict (a result file's, a worker's, a
  server's) into a record and checks every field against its type: a malformed file or reply is a
  ``ValueError`` that names the field (``rows[3].runs[0].batch_size: expected int, got str``).
  :func:`read` does it for a whole result file;
* **the checks' common parts**: which checks are informational (:func:`informational`), the kit's
  call-counter check (:func:`kit_calls_check`), and a failure's recorded fact (:func:`failure`).

Standard library only: the checks' results are read where vLLM is not installed (the book's
chapters read the stored H200 files).
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
import types
import typing
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------

#: The modes, in the order the checks run and list them.
MODES = ("default", "invariant", "kit", "kit+attention")
#: The modes with the kit's plugin switched on.
KIT_MODES = ("kit", "kit+attention")
#: The name under which the plugin registers the kit's attention backend in vLLM 0.26 (CUDA).
KIT_ATTENTION_BACKEND = "CUSTOM"
#: Each mode's role in the book's colour rule: vLLM as installed is the peer, the three
#: batch-invariant modes are invariant implementations.
ROLE = {"default": "peer", "invariant": "invariant", "kit": "invariant", "kit+attention": "invariant"}
#: What each mode switches, in one line (the checks' plans and the book print it).
DESCRIPTION = {
    "default": "vLLM as installed",
    "invariant": "VLLM_BATCH_INVARIANT=1: vLLM's own batch-invariant mode",
    "kit": "KIT_BATCH_INVARIANT=1: the kit's plugin (vLLM's own mode under it on a GPU)",
    "kit+attention": "kit mode with the kit's attention backend (vLLM's CUSTOM backend on a GPU, "
                     "KIT_ATTENTION=1 on the CPU)",
}


#: ``--vllm-mode-under-kit`` of the checks and the benchmark: the kit's modes with vLLM's own mode
#: under them (``on``), without it (``off``: ``KIT_VLLM_INVARIANT=0``, the kit alone), or ``both``.
VLLM_UNDER_KIT = ("on", "off", "both")
#: The suffix of a kit mode's name without vLLM's own mode under it.
ALONE = " alone"
#: The help of ``--vllm-mode-under-kit`` (both commands).
UNDER_KIT_HELP = ("kit modes with vLLM's own mode under them: on, off (the kit alone, KIT_VLLM_INVARIANT=0: "
                  "kit+attention only), both")


def label(mode: str, vllm_invariant: bool | None) -> str:
    """The name of a (mode, vLLM's mode under kit) variant in the rows and checks: ``<mode>``, or
    ``<mode> alone`` for a kit mode without vLLM's own mode."""
    return f"{mode}{ALONE}" if check_mode(mode) in KIT_MODES and vllm_invariant is False else mode


def variant_of(name) -> tuple:
    """``(mode, vllm_invariant)`` of a :func:`label`: ``None`` for default, ``True`` for
    invariant and a kit mode, ``False`` for ``<kit mode> alone``; a ``ValueError`` naming it
    otherwise."""
    if isinstance(name, str) and name.endswith(ALONE) and name[:-len(ALONE)] in KIT_MODES:
        return name[:-len(ALONE)], False
    return check_mode(name), None if name == "default" else True


def variants(modes: list, under_kit: str) -> list:
    """``[(mode, vllm_invariant)]`` of the requested modes: ``vllm_invariant`` is ``None`` for
    default, ``True`` for invariant, and for kit modes as ``--vllm-mode-under-kit`` says."""
    check_under_kit(under_kit, modes)
    out = []
    for m in modes:
        if check_mode(m) not in KIT_MODES:
            out.append((m, None if m == "default" else True))
            continue
        out += [(m, on) for on in {"on": (True,), "off": (False,), "both": (True, False)}[under_kit]]
    return out


def check_under_kit(under_kit, modes) -> str:
    """``under_kit`` if it is one of :data:`VLLM_UNDER_KIT` and fits ``modes``; a ``ValueError``
    naming ``--vllm-mode-under-kit`` otherwise.  The kit alone needs the kit's attention: with
    vLLM's FlashAttention and vLLM's own mode off, decode splits the KV sequence by the batch
    (:data:`batch_invariance_kit.vllm.plugin.VLLM_MODE_PARTS`), so ``off``/``both`` refuse mode ``kit``."""
    if under_kit not in VLLM_UNDER_KIT:
        raise ValueError(f"--vllm-mode-under-kit must be one of {list(VLLM_UNDER_KIT)}, got {under_kit!r}")
    if under_kit != "on" and "kit" in modes:
        raise ValueError("--vllm-mode-under-kit off/both needs the kit's attention: mode kit (vLLM's FlashAttention) "
                         "without vLLM's own mode splits the KV sequence by the batch; use --modes kit+attention")
    return under_kit


def describe(name: str) -> str:
    """What a :func:`label` switches, in one line (:data:`DESCRIPTION`, and for ``<mode> alone``
    the kit without vLLM's own mode)."""
    mode, on = variant_of(name)
    if on is False:
        return f"{DESCRIPTION[mode]}; KIT_VLLM_INVARIANT=0: vLLM's own mode off under it (the kit alone)"
    return DESCRIPTION[mode]


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`; a ``TypeError``/``ValueError`` naming it otherwise."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, got {type(mode).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    return mode


def attention_backend(mode: str, requested: str | None, *, gpu: bool) -> str | None:
    """The attention backend an engine of ``mode`` asks vLLM for: the kit's (:data:`KIT_ATTENTION_BACKEND`)
    in ``kit+attention`` on a GPU (on the CPU the plugin swaps it in itself), ``requested`` otherwise
    (``None``: vLLM's choice)."""
    return KIT_ATTENTION_BACKEND if check_mode(mode) == "kit+attention" and gpu else requested


def informational(mode: str, platform: str) -> bool:
    """Whether a mode's (or a :func:`label`'s) invariance checks are informational: vLLM as
    installed promises nothing, and vLLM's own mode cannot run on its CPU build."""
    mode = variant_of(mode)[0]
    return mode == "default" or (mode == "invariant" and platform == "cpu")


# ---------------------------------------------------------------------------------------------
# Prompts (deterministic: the same seed gives the same token ids on every machine)
# ---------------------------------------------------------------------------------------------

#: Token ids of the random prompts are drawn below this (the kit's models' vocabulary).
VOCAB = 32768


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list:
    """``length`` token ids in ``2..vocab-1`` (0 and 1 are the configs' bos/eos) from ``seed``."""
    if not (isinstance(length, int) and length >= 1):
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if not (isinstance(vocab, int) and vocab > 2):
        raise ValueError(f"vocab must be an int > 2, got {vocab!r}")
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


@dataclass(frozen=True)
class SeededPrompt:
    """A prompt of the checks, named by what it is and drawn from its seed."""
    name: str
    length: int
    seed: int

    def tokens(self, vocab: int = VOCAB) -> list:
        return random_prompt(self.length, self.seed, vocab)


#: The short prompt answered alone and at a random place in batches of growing size.
TARGET = SeededPrompt("target", 100, 1234)
#: The long prompt answered alone and among many random requests, many times: the needle.
NEEDLE = SeededPrompt("needle", 257, 4321)


# ---------------------------------------------------------------------------------------------
# Parsing a dict into a record
# ---------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if typing.get_origin(tp) in (list, tuple):
        return "list"
    if typing.get_origin(tp) is dict:
        return "object"
    return {str: "str", int: "int", float: "number", bool: "bool", dict: "object"}.get(tp, getattr(tp, "__name__",
                                                                                                   str(tp)))


def _got(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _value(tp, v, where: str, extra: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _value(a, v, where, extra)
            except ValueError:
                if len(args) - (type(None) in args) == 1:
                    raise
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {_got(v)}")
    if dataclasses.is_dataclass(tp):
        return parse(tp, v, where, extra=extra)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {_got(v)}")
        item = args[0] if args else typing.Any
        return [_value(item, x, f"{where}[{i}]", extra) for i, x in enumerate(v)]
    if origin is dict or tp is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where}: expected an object, got {_got(v)}")
        if len(args) != 2:
            return dict(v)
        return {k: _value(args[1], x, f"{where}.{k}", extra) for k, x in v.items()}
    if tp is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{where}: expected bool, got {_got(v)}")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{where}: expected int, got {_got(v)}")
        return v
    if tp is float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{where}: expected a number, got {_got(v)}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise ValueError(f"{where}: expected str, got {_got(v)}")
        return v
    raise TypeError(f"{where}: no rule for the type {tp!r}")


_HINTS: dict = {}


def parse(cls, data, where: str, *, extra: str = "forbid"):
    """``data`` as the record ``cls`` (a dataclass), every field checked against its annotation
    (nested records, lists and objects included).  ``where`` names ``data`` in the errors (a
    path such as ``rows[3]``).  ``extra``: ``"forbid"`` (an unknown key is an error: the kit
    writes these dicts) or ``"ignore"`` (a server's reply carries fields the check does not read).

    Raises ``ValueError`` naming the field: ``rows[3].runs[0].batch_size: expected int, got str
    'x'``, ``rows[3]: missing field 'runs'``, ``rows[3]: unknown field(s) ['rnus']``."""
    if extra not in ("forbid", "ignore"):
        raise ValueError(f"extra must be 'forbid' or 'ignore', got {extra!r}")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object ({cls.__name__}), got {_got(data)}")
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    hints = _HINTS[cls]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown and extra == "forbid":
        raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
    kw = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing field {name!r} of {cls.__name__}")
            continue
        kw[name] = _value(hints[name], data[name], f"{where}.{name}", extra)
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:   # a record's own consistency check
        raise ValueError(f"{where}: {e}") from e


def to_dict(record) -> dict:
    """A record as the plain dict a JSON file holds."""
    return dataclasses.asdict(record)


# ---------------------------------------------------------------------------------------------
# The comparison of one answer with the answer alone
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Comparison:
    """An answer against the reference one (the target alone), bitwise.  ``top_equal``: the top-k
    log-probabilities too (``None`` where they were not asked for)."""
    tokens_equal: bool
    logprobs_equal: bool
    first_token_diff: int | None
    first_logprob_diff: int | None
    logprobs_unequal: int
    max_abs_diff: float
    top_equal: bool | None = None

    @property
    def bitwise(self) -> bool:
        return self.tokens_equal and self.logprobs_equal and self.top_equal is not False


def _first(a, b, unequal) -> int | None:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if unequal(x, y)), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def compare(ref_tokens, ref_lps, tokens, lps, ref_top=None, top=None) -> Comparison:
    """``tokens``/``lps`` against ``ref_tokens``/``ref_lps``, bitwise; with ``ref_top`` and
    ``top``, the top-k log-probabilities too.

    Log-probabilities are Python floats holding fp32 values (the offline check's), or the literal
    text of the JSON numbers a server sent (the online check's): ``==`` is bitwise for both, and
    a NaN is never equal (not ``list == list``, which tests identity first).  A shorter answer is
    a difference at its end."""
    n = min(len(ref_lps), len(lps))
    unequal = [i for i in range(n) if not (ref_lps[i] == lps[i])]
    diffs = [abs(float(a) - float(b)) for a, b in zip(ref_lps[:n], lps[:n])]
    return Comparison(
        tokens_equal=list(ref_tokens) == list(tokens),
        logprobs_equal=len(ref_lps) == len(lps) and not unequal,
        first_token_diff=_first(list(ref_tokens), list(tokens), lambda x, y: x != y),
        first_logprob_diff=unequal[0] if unequal else (None if len(ref_lps) == len(lps) else n),
        logprobs_unequal=len(unequal) + abs(len(ref_lps) - len(lps)),
        max_abs_diff=max(diffs) if diffs and all(map(math.isfinite, diffs)) else (0.0 if not diffs else math.inf),
        top_equal=None if ref_top is None and top is None else list(ref_top or ()) == list(top or ()))


def distinct(completions: list) -> dict:
    """``completions``: ``[(tokens, logprobs)]``; counts of distinct token / log-prob sequences
    (log-probs keyed by ``repr``: bitwise for floats, and a NaN equals a NaN of the same bits)."""
    return {"n": len(completions),
            "unique_token_sequences": len({tuple(t) for t, _ in completions}),
            "unique_logprob_sequences": len({tuple(repr(x) for x in lp) for _, lp in completions})}


# ---------------------------------------------------------------------------------------------
# What a worker returns (runner.run_targets and its decode-vs-prefill experiment)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Completion:
    """One answer: its token ids, the sampled token's raw fp32 log-probability per step, its text
    (``None`` without a tokenizer)."""
    tokens: list[int]
    logprobs: list[float]
    text: str | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} logprobs")


@dataclass(frozen=True, kw_only=True)
class BatchRun:
    """The targets answered in one batch: its seed, the targets' places, the batch's size and
    prompt tokens, its wall time, the targets' answers."""
    seed: int
    positions: list[int]
    requests: int
    prompt_tokens: int
    seconds: float
    targets: list[Completion]


@dataclass(frozen=True, kw_only=True)
class Prefill:
    """Decode vs prefill of one target: the decode's log-probability of each generated token and
    the prefill's (the prompt plus the answer but its last token, ``prompt_logprobs=0``)."""
    target: int
    prompt_len: int
    decode: list[float]
    prefill: list[float]
    last_token_equal: bool
    seconds: float | None = None
    kit_calls: dict[str, int] | None = None


@dataclass(frozen=True, kw_only=True)
class TargetsResult:
    """A ``targets`` experiment of the worker: every target alone, then in each batch; decode vs
    prefill of the first few."""
    alone: list[Completion]
    alone_s: float
    batches: list[BatchRun]
    decode_vs_prefill: list[Prefill]
    seconds: float | None = None
    kit_calls: dict[str, int] | None = None

    def __post_init__(self):
        for i, b in enumerate(self.batches):
            if len(b.targets) != len(self.alone):
                raise ValueError(f"batches[{i}] answers {len(b.targets)} targets, alone {len(self.alone)}")

    def _chosen(self, batches) -> list:
        return self.batches if batches is None else [self.batches[i] for i in batches]

    def against_alone(self, target: int, batches=None) -> list:
        """``[(batch, Comparison)]``: target ``target`` in each batch (``batches``: indices, default
        all) against its answer alone."""
        a = self.alone[target]
        return [(b, compare(a.tokens, a.logprobs, b.targets[target].tokens, b.targets[target].logprobs))
                for b in self._chosen(batches)]

    def distinct(self, target: int, batches=None) -> dict:
        """:func:`distinct` over target ``target`` alone and in each batch (``batches`` as above)."""
        runs = [self.alone[target]] + [b.targets[target] for b in self._chosen(batches)]
        return distinct([(c.tokens, c.logprobs) for c in runs])


# ---------------------------------------------------------------------------------------------
# The rows of the result files (one record per kind of row)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Row:
    """What every row says: which experiment (``op``), which mode (``impl``: a :func:`label`), which model."""
    op: str
    impl: str
    model: str
    init_s: float | None = None
    seconds: float | None = None
    engine: dict | None = None
    kit_calls: dict[str, int] | None = None

    def __post_init__(self):
        variant_of(self.impl)


@dataclass(frozen=True, kw_only=True)
class FailedRow(Row):
    """An experiment that gave no result: its traceback (``error``), why it was ``skipped``, or
    why it is ``missing`` (the worker stopped before it)."""
    error: str | None = None
    skipped: str | None = None
    missing: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if (self.error, self.skipped, self.missing) == (None, None, None):
            raise ValueError("a failed row needs an error, skipped or missing")


@dataclass(frozen=True, kw_only=True)
class InBatch(Comparison):
    """A prompt answered in a batch of ``batch_size`` requests, at ``position``, against its answer alone."""
    batch_size: int
    position: int


@dataclass(frozen=True, kw_only=True)
class BsRun(InBatch):
    prompt_tokens_in_batch: int


@dataclass(frozen=True, kw_only=True)
class BsRow(Row):
    """bs1 vs bsN: the :data:`TARGET` prompt alone (``bs1_*``) and in batches of other sizes."""
    batch_sizes: list[int]
    target_len: int
    new_tokens: int
    runs: list[BsRun]
    bs1_tokens: list[int]
    bs1_logprobs: list[float]
    all_equal: bool


@dataclass(frozen=True, kw_only=True)
class NeedleTrial(InBatch):
    trial: int


@dataclass(frozen=True, kw_only=True)
class NeedleRow(Row):
    """The :data:`NEEDLE` prompt alone and in the trials: distinct answers among them."""
    needle_len: int
    trials: list[NeedleTrial]
    n: int
    unique_token_sequences: int
    unique_logprob_sequences: int


@dataclass(frozen=True, kw_only=True)
class DecodeVsPrefillRow(Row):
    prompt_len: int
    positions: int
    equal_positions: int
    first_unequal: int | None
    max_abs_diff: float
    decode_logprobs: list[float]
    prefill_logprobs: list[float]
    last_token_equal: bool


@dataclass(frozen=True, kw_only=True)
class ThroughputRow(Row):
    """One timed ``generate`` of many prompts (a serving rate, CPU scheduling included)."""
    prompts: int
    new_tokens_each: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class OnlineRow(Row):
    """One copy of a target answered by a server under load (or ``after`` the load rounds):
    its request's times (seconds after the round's start), how many other requests were in
    flight beside it, the error of its request, its answer's length and its comparison with the
    answer alone (``None`` without an answer)."""
    round: int | str
    name: str
    start_s: float
    end_s: float
    error: str | None = None
    in_flight_beside: int | None = None
    tokens: int | None = None
    compared: Comparison | None = None


#: The record of each ``op`` whose experiment gave a result.
ROW_TYPES = {"vllm_bs": BsRow, "vllm_needle": NeedleRow, "vllm_decode_vs_prefill": DecodeVsPrefillRow,
             "vllm_throughput": ThroughputRow, "vllm_online": OnlineRow}
_FAILED = ("error", "skipped", "missing")


def parse_row(d, where: str = "row"):
    """One row of a result file as its record (:data:`ROW_TYPES`, or :class:`FailedRow` for an
    offline experiment that gave no result)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object, got {_got(d)}")
    op = d.get("op")
    if op not in ROW_TYPES:
        raise ValueError(f"{where}.op: expected one of {list(ROW_TYPES)}, got {op!r}")
    if op != "vllm_online" and any(k in d for k in _FAILED):
        return parse(FailedRow, d, where)
    return parse(ROW_TYPES[op], d, where)


@dataclass(frozen=True, kw_only=True)
class CheckRecord:
    """A check of a result file: its name, whether it passed, whether it is informational; its
    other keys (``details``) are what it measured."""
    name: str
    passed: bool
    informational: bool = False
    details: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Result:
    """A result file of a vLLM check: provenance, typed rows, checks, and the rest (``plan``,
    ``jobs``, ``servers``, ...) as stored."""
    provenance: dict
    rows: list
    checks: list
    extra: dict

    def rows_of(self, cls) -> list:
        return [r for r in self.rows if isinstance(r, cls)]

    def keys(self) -> list:
        """``(model, mode)`` pairs in the order the rows give them."""
        return list(dict.fromkeys((r.model, r.impl) for r in self.rows))


def read(doc, where: str = "result") -> Result:
    """A result file of :mod:`.check` or :mod:`.online` (its parsed JSON) as a :class:`Result`;
    ``ValueError`` naming the first malformed field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object, got {_got(doc)}")
    for key, tp in (("provenance", dict), ("rows", list), ("checks", list)):
        if not isinstance(doc.get(key), tp):
            raise ValueError(f"{where}.{key}: expected {'an object' if tp is dict else 'a list'}, "
                             f"got {_got(doc.get(key))}")
    rows = [parse_row(r, f"{where}.rows[{i}]") for i, r in enumerate(doc["rows"])]
    checks = []
    for i, c in enumerate(doc["checks"]):
        if not isinstance(c, dict):
            raise ValueError(f"{where}.checks[{i}]: expected an object, got {_got(c)}")
        base = {k: c[k] for k in ("name", "passed", "informational") if k in c}
        rec = parse(CheckRecord, base, f"{where}.checks[{i}]")
        checks.append(dataclasses.replace(rec, details={k: v for k, v in c.items() if k not in base}))
    return Result(provenance=doc["provenance"], rows=rows, checks=checks,
                  extra={k: v for k, v in doc.items() if k not in ("provenance", "rows", "checks")})


# ---------------------------------------------------------------------------------------------
# A server's reply (online: /v1/completions with logprobs, parsed with parse_float=str)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ReplyLogprobs:
    tokens: list[str]
    token_logprobs: list[str]
    top_logprobs: list[dict[str, str] | None] | None = None


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One ``choices[i]`` of a completion, or of a streamed chunk (its log-probabilities as the
    literal text of the server's JSON numbers)."""
    text: str | None = None
    finish_reason: str | None = None
    logprobs: ReplyLogprobs | None = None


# ---------------------------------------------------------------------------------------------
# The checks' common parts
# ---------------------------------------------------------------------------------------------

#: The kit's replacements that must have run inside vLLM, per platform.
KIT_CALLS_NEEDED = {"cpu": ("linear", "rms_norm"), "cuda": ("rms_norm",)}


def kit_calls_check(label: str, calls: dict | None, need, **details) -> dict:
    """The check that the kit's replacements ``need`` ran inside vLLM (their call counters > 0)."""
    calls = calls or {}
    return {"name": f"{label}: the kit's replacements ran inside vLLM (call counters > 0: {', '.join(need)})",
            "passed": all(calls.get(k, 0) > 0 for k in need), "calls": calls, **details}


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def failure(text: str | None) -> dict:
    """The recorded fact of a traceback or a log's tail: the ``error`` (its last line), and
    where it was raised: the innermost frame's ``call`` (``path/in/the/package.py:line in
    function``, the path from its package on: no machine path) and the ``code`` on that line."""
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    out = {"error": lines[-1].strip() if lines else None, "call": None, "code": None}
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m:
            path = re.split(r"(?:site-packages|dist-packages)/", m["file"])[-1]
            if path == m["file"]:
                path = "/".join(path.split("/")[-2:])
            out["call"] = f"{path}:{m['line']} in {m['func']}"
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out["code"] = nxt if nxt and not _FRAME.match(lines[i + 1]) and nxt != out["error"] else None
            break
    return out
