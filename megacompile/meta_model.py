"""Models on the meta device and their compiled program, for `inspect` and `plan` alike.

    model, config = build_meta_model("llama-3-70b", layers=None, dtype=torch.bfloat16)
    program = capture_program(model, batch=1, seq=4096, slots=2, hardware=BUILTIN["h200"])

No weights are allocated: the model is built under `torch.device("meta")`, Dynamo and
AOTAutograd trace it with meta inputs, and the megatrain backend compiles both directions
without its runtime (`runtime=False`): the program's graphs, schedule and memory plan, nothing
to run. inspect.py reports on one such program; plan.py and plan_capture.py compile the first
layers this way and extrapolate. This module imports neither of them.
"""
from __future__ import annotations

import torch

from . import meta_attention
from .backend import Program, megatrain_backend, programs_of
from .hardware import Hardware
from .presets import load_config


def build_model_from_config(config, layers: int | None, dtype: torch.dtype):
    """A model on the meta device (no weights allocated), keeping the first `layers` layers.
    A vision-language config builds the whole VLM (its layers count is the language stack's)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from .presets import keep_layers
    config = copy.deepcopy(config)
    if layers is not None:
        keep_layers(config, layers)
    config.use_cache = config.get_text_config(decoder=True).use_cache = False
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):  # fused attention, as the real kernels (see meta_attention.py)
        model = auto.from_config(config, dtype=dtype, attn_implementation=meta_attention.register())
    return model.train()


def check_positive(**values) -> None:
    """Refuse sizes that are not whole numbers >= 1 (None: not given)."""
    from .errors import ConfigError
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r}: give a positive integer (--{name} N, N >= 1).")


def check_decoder_only(config, source) -> None:
    """Refuse, before anything is built or traced, a config megatrain cannot train: an
    encoder-decoder model (T5, BART, Whisper), or one transformers has no causal-LM class for.
    (Encoder-only models that do have one, e.g. BERT, are refused once built: capture.check_model.)"""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    from .errors import UnsupportedModelError
    name = source if isinstance(source, str) else type(config).__name__
    model_type = getattr(config, "model_type", None)
    supported = "megatrain trains decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, Mixtral, DeepSeek, ...) " \
                "and the language stack of VLMs"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} (model_type={model_type!r}) is an encoder-decoder model; {supported}. "
                                    "Give the config of a decoder-only model.")
    vlm = getattr(config, "vision_config", None) is not None
    mapping = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if vlm else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if model_type not in mapping:
        raise UnsupportedModelError(f"{name} (model_type={model_type!r}) has no "
                                    f"{'image-text-to-text' if vlm else 'causal-LM (decoder-only)'} model in "
                                    f"transformers; {supported}. Give the config of a decoder-only model.")


def build_meta_model(source: str, layers: int | None, dtype: torch.dtype):
    """A model on the meta device from a preset, config.json or model directory (presets.load_config),
    after checking it is a decoder-only LM and `layers` is at most its depth."""
    from .capture import check_model
    from .errors import ConfigError
    config = load_config(source)
    check_decoder_only(config, source)
    if layers is not None:
        depth = config.get_text_config(decoder=True).num_hidden_layers
        if not 1 <= layers <= depth:
            raise ConfigError(f"--layers {layers}: {source} has {depth} decoder layers; give 1 to {depth}, "
                              "or leave --layers out to keep them all.")
    model = build_model_from_config(config, layers, dtype)
    check_model(model, training=True, use_cache=False)   # encoder-only (bidirectional) models
    return model, model.config


def text_positions(model, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Meta position ids for a VLM with 3-D rotary positions (Qwen-VL), which megatrain's VLM
    recipe computes eagerly (megacompile/vlm.py): the planner captures text tokens only."""
    base = getattr(model, "model", None)
    if not hasattr(base, "compute_3d_position_ids"):
        return {}
    text = model.config.get_text_config(decoder=True)
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    sections = rope.get("mrope_section")
    return {"position_ids": torch.zeros(len(sections or (0, 0, 0)), batch, seq, dtype=torch.long, device="meta")}


def meta_outputs(gm: torch.fx.GraphModule) -> tuple:
    """What the Dynamo graph `gm` returns, as meta tensors of its traced shapes (its output
    node's example values), without running it."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")

    def empty(a):
        val = a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else a
        if isinstance(val, torch.Tensor):
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta",
                                       requires_grad=val.requires_grad)
        return val
    return tuple(torch.fx.node.map_aggregate(out.args[0], empty))


def capture_program(model, batch: int, seq: int, slots: int, hardware: Hardware | None = None,
                    options: dict | None = None) -> Program:
    """Compile forward and backward for meta inputs without running megatrain's runtime. For a
    GPU profile the graph holds the fused Triton kernels a CUDA run selects (kernels="auto"),
    unless `options` name the kernels."""
    gpu = hardware is not None and hardware.name != "cpu"

    def capture(gm, example_inputs, **_):
        outputs = meta_outputs(gm)   # (before the passes change the graph)
        megatrain_backend(gm, example_inputs, options={"device": "cpu", "slots": slots, "hardware": hardware,
                                                       **({"kernels": "triton"} if gpu else {}), **(options or {})},
                          runtime=False)
        # Shapes only. Running the graph on meta tensors would run each layer kind's
        # invoke_subgraph call eagerly, and torch traces the subgraph again at every call for its
        # schema: 7 of the 25 s of `inspect llama-3-70b`.
        return lambda *_args: outputs

    torch._dynamo.reset()
    from . import compile_start
    compile_start.register()   # (reset drops Dynamo's callbacks; a later real compile needs this one)
    # what the compile-start callback does for a real compile (this backend is not "megatrain",
    # which it looks for): the output hooks the config asks for, the attention a run selects, and
    # the layers' compile regions
    compile_start.prepare(model, options)
    compiled = torch.compile(model, backend=capture)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    compiled(input_ids=ids, labels=ids, use_cache=False, **text_positions(model, batch, seq))
    return programs_of(model)[-1]
