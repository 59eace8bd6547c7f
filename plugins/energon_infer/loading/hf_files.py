"""What a Hugging Face model directory says besides the weights, read the way transformers reads it.

* :class:`ChatTemplate`: the model's chat template through transformers' own loader
  (``AutoTokenizer.from_pretrained`` finds ``chat_template.jinja``, ``chat_template.json`` or the
  ``chat_template`` of ``tokenizer_config.json``, whichever the saving version wrote) and rendered
  with its ``apply_chat_template`` (a sandboxed Jinja environment with the template helpers:
  ``raise_exception``, ``strftime_now``, the special tokens); without one, ``"role: content"`` lines.
* :func:`generation_defaults`: ``generation_config.json``'s sampling defaults as
  :class:`~energon_infer.sampling.SamplingParams` fields (``do_sample: false`` means greedy).
* :func:`resolve_dtype`: ``dtype="auto"`` (the default): the dtype ``config.json`` was saved in, where the device
  computes in it natively (bf16 on a CPU with bf16 matrix instructions, fp16 on CUDA), else float32.
* :class:`HFTokenizer`: a transformers tokenizer (``AutoTokenizer`` objects) behind the ``tokenizers``
  interface the engine uses (``encode(text).ids``, ``decode(ids)``).

Example:
    >>> ChatTemplate(None).render([{"role": "user", "content": "hi"}])
    'user: hi\\nassistant:'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "HFTokenizer", "as_engine_tokenizer", "auto_dtype", "cpu_has_native_bf16",
           "generation_defaults", "resolve_dtype", "load_hf_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                    "tokenizer.model", "vocab.json")


def load_hf_tokenizer(path: str | Path) -> Any | None:
    """``AutoTokenizer.from_pretrained(path)`` when the directory has tokenizer files and transformers is
    installed, else ``None`` (the caller falls back to ``tokenizer.json`` alone)."""
    path = Path(path)
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 - a directory transformers cannot read: no template, not a failure
        return None


class HFTokenizer:
    """A transformers tokenizer with the ``tokenizers`` interface (``encode(text).ids``, ``decode(ids)``).

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` (what ``AutoTokenizer.from_pretrained`` returns).
    """

    class _Encoding:
        __slots__ = ("ids",)

        def __init__(self, ids: list[int]):
            self.ids = ids

    def __init__(self, tokenizer: Any):
        self.hf = tokenizer

    def encode(self, text: str) -> HFTokenizer._Encoding:
        return self._Encoding(list(self.hf.encode(text)))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def as_engine_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer the engine keeps: a transformers tokenizer is wrapped in :class:`HFTokenizer`; a
    ``tokenizers.Tokenizer`` (or anything whose ``encode`` returns an object with ``.ids``) is kept."""
    if tokenizer is None or isinstance(tokenizer, HFTokenizer):
        return tokenizer
    if hasattr(tokenizer, "apply_chat_template") or hasattr(tokenizer, "convert_ids_to_tokens"):
        return HFTokenizer(tokenizer)
    return tokenizer


class ChatTemplate:
    """Turns chat messages into the prompt text (see the module docstring).

    Args:
        tokenizer: a transformers tokenizer (or :class:`HFTokenizer`) whose ``chat_template`` is used; ``None``
            or one without a template: ``"role: content"`` lines ending with ``"assistant:"``.
    """

    def __init__(self, tokenizer: Any):
        hf = tokenizer.hf if isinstance(tokenizer, HFTokenizer) else tokenizer
        self.hf = hf if hf is not None and getattr(hf, "chat_template", None) else None

    @classmethod
    def for_engine(cls, engine: Any) -> ChatTemplate:
        """The engine's own transformers tokenizer if it has a template, else the model directory's."""
        own = cls(engine.tokenizer if hasattr(engine.tokenizer, "apply_chat_template")
                  or isinstance(engine.tokenizer, HFTokenizer) else None)
        if own.hf is not None:
            return own
        return cls(load_hf_tokenizer(engine.source.path))

    @property
    def source(self) -> str:
        return "the model's chat template" if self.hf is not None else "'role: content' lines (no chat template)"

    @property
    def text(self) -> str:
        """The template's Jinja source (all of its named templates); ``""`` without one."""
        raw = self.hf.chat_template if self.hf is not None else None
        return "\n".join(raw.values()) if isinstance(raw, dict) else (raw or "")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's ``tools`` entries) go to the template, which writes them
        where the model expects them (without a template: a ``tools:`` line of JSON first)."""
        if self.hf is None:
            def line(m: dict[str, Any]) -> str:
                calls = [c["function"] for c in m.get("tool_calls") or ()]
                return f"{m['role']}: {m['content']}" + (json.dumps(calls) if calls else "") + "\n"

            head = f"tools: {json.dumps(tools)}\n" if tools else ""
            return head + "".join(map(line, messages)) + ("assistant:" if add_generation_prompt else "")
        return self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)


# generation_config.json key -> SamplingParams field
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(path: str | Path) -> dict[str, Any]:
    """Sampling defaults from ``path/generation_config.json`` (``{}`` without one), as SamplingParams fields.

    ``do_sample: false`` (greedy) gives ``temperature=0``; values transformers would ignore for greedy
    decoding (``temperature``, ``top_p``, ``top_k``) are then left out.
    """
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except ValueError:
        return {}
    out: dict[str, Any] = {}
    for key, name in _GENERATION_KEYS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    if raw.get("do_sample") is False:
        for name in ("temperature", "top_p", "top_k"):
            out.pop(name, None)
        out["temperature"] = 0.0
    if out.get("top_k") == 50 and "do_sample" not in raw:
        out.pop("top_k")  # transformers writes its own default 50 into every file; not the model's choice
    return out


_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "half": "float16"}


# CPU flags of matrix instructions that compute in bf16 (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU's flags include bf16 matrix instructions (without them bf16 runs emulated, slower than
    float32). False where ``/proc/cpuinfo`` is unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(_CPU_BF16_FLAGS & set(value.split()))
    return False


def _checkpoint_dtype(path: str | Path) -> str:
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text()) if file.is_file() else {}
    if not isinstance(raw, dict):  # not a config: the config loader refuses it, naming the file
        return "float32"
    named = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    named = str(named).removeprefix("torch.")
    if named not in _DTYPE_NAMES:
        raise ValueError(f"dtype='auto': {file} says dtype {named!r}, which this runtime does not run; pass "
                         "dtype='float32', 'bfloat16' or 'float16'")
    return _DTYPE_NAMES[named]


def auto_dtype(source: Any, device: str | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for ``dtype="auto"``: the checkpoint's dtype where ``device`` computes in it natively, else
    float32. ``source``: a model directory (``config.json``'s ``dtype`` or ``torch_dtype``; float32 when it names
    none), or a ``{name: tensor}`` map (its floating tensors' dtype). ``device`` None: CUDA when there is one, else
    the CPU."""
    import torch

    if isinstance(source, (str, Path)):
        named = _checkpoint_dtype(source)
    else:
        values = source.values() if hasattr(source, "values") else ()
        first = next((t.dtype for t in values if t.is_floating_point()), torch.float32)
        named = _DTYPE_NAMES.get(str(first).removeprefix("torch."), "float32")
    if named == "float32":
        return named, "the checkpoint's dtype"
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        if named == "bfloat16" and not torch.cuda.is_bf16_supported():
            return "float16", "the checkpoint is bfloat16, which this GPU does not compute in"
        return named, "the checkpoint's dtype"
    if named == "bfloat16" and cpu_has_native_bf16():
        return named, "the checkpoint's dtype; this CPU has bf16 matrix instructions"
    why = ("this CPU has no bf16 matrix instructions" if named == "bfloat16"
           else "float16 runs emulated on a CPU")
    return "float32", f"the checkpoint is {named}, but {why} (pass --dtype {named} to keep it)"


def resolve_dtype(path: str | Path, dtype: str, device: str | None = None) -> str:
    """``dtype`` itself, or for ``"auto"`` what :func:`auto_dtype` chooses."""
    return dtype if dtype != "auto" else auto_dtype(path, device)[0]
