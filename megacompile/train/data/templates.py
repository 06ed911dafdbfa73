"""LLaMA-Factory's chat templates (0.9.5), by LLaMA-Factory's names, as data.

A template is a set of *slots*: the pieces a turn is rendered from. A slot is a string (with a
``{{content}}`` placeholder where the message goes) or :data:`BOS` / :data:`EOS` (the
tokenizer's BOS / EOS token, skipped when the tokenizer has none).
encode.py turns slots into token ids the way LLaMA-Factory does: each string piece is tokenized
on its own, so ``["Human: {{content}}", EOS, "\\nAssistant:"]`` gives three tokenizations.

    >>> t = get_template("qwen")
    >>> t.user, t.default_system
    (('<|im_start|>user\\n{{content}}<|im_end|>\\n<|im_start|>assistant\\n',), 'You are Qwen, ...')

The strings below must equal LLaMA-Factory's byte for byte (tests/test_lf_data.py compares the
token ids with ones LLaMA-Factory produced); the defaults that LLaMA-Factory's
``register_template`` fills in (an assistant slot ending in EOS unless ``efficient_eos``, the
function slot copied from the assistant slot, the observation slot from the user slot) are
filled in the same way by :func:`_define`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .registry import DataError

CONTENT = "{{content}}"


@dataclass(frozen=True)
class Special:
    """The tokenizer's BOS or EOS token as a slot (its id, whatever the tokenizer calls it).
    Compared by value, not identity: templates travel to datasets.map's worker processes."""
    which: str

    def __repr__(self) -> str:
        return self.which.upper()


BOS, EOS = Special("bos"), Special("eos")


@dataclass(frozen=True)
class Template:
    """A chat template. `system_in_user`: the system text is glued to the first user message
    (LLaMA-Factory's Llama2Template: llama2, mistral, gemma); `reasoning`: the assistant reply
    carries a thought block that `enable_thinking` and `mask_history` act on
    (LLaMA-Factory's ReasoningTemplate: qwen3, gpt_oss, deepseekr1)."""
    name: str
    user: tuple
    assistant: tuple
    system: tuple
    function: tuple
    observation: tuple
    prefix: tuple = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    tool_call_words: tuple[str, str] = ("<tool_call>", "</tool_call>")
    tool_format: str = "default"
    efficient_eos: bool = False
    replace_eos: bool = False
    system_in_user: bool = False
    reasoning: bool = False
    enable_thinking: bool = True
    preserve_thinking: bool = False    # mask_history keeps the earlier replies' thoughts (LF's preserve_thinking)
    tools_slot: tuple | None = None    # phi4_mini: the tool text in its own slot, not a tool format
    replace_jinja: bool = False        # the tokenizer's chat_template is replaced by this template's

    def configured(self, default_system: str | None = None, tool_format: str | None = None,
                   enable_thinking: bool = True, preserve_thinking: bool = False) -> "Template":
        """This template with a run's options, as LLaMA-Factory's get_template_and_fix_tokenizer
        applies them: `tool_format` replaces the function slot with the plain one
        (``{{content}}`` + EOS, not the template's own end marker: LLaMA-Factory does exactly this)."""
        t = self
        if tool_format is not None:
            t = replace(t, tool_format=tool_format, tools_slot=None,
                        function=(CONTENT,) if t.efficient_eos else (CONTENT, EOS))
        if default_system is not None:
            t = replace(t, default_system=default_system)
        if t.reasoning:
            t = replace(t, enable_thinking=enable_thinking, preserve_thinking=preserve_thinking)
        return t


def _define(name: str, user: tuple | None = None, assistant: tuple | None = None, system: tuple | None = None,
            function: tuple | None = None, observation: tuple | None = None, efficient_eos: bool = False,
            **kw) -> Template:
    """A template with LLaMA-Factory's register_template defaults for the slots not given."""
    plain = (CONTENT,) if efficient_eos else (CONTENT, EOS)
    return Template(name=name, user=user or (CONTENT,), assistant=assistant or plain, system=system or (CONTENT,),
                    function=function or assistant or plain, observation=observation or user or (CONTENT,),
                    efficient_eos=efficient_eos, **kw)


_IM = dict(user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
           assistant=("{{content}}<|im_end|>\n",), system=("<|im_start|>system\n{{content}}<|im_end|>\n",))
_QWEN = dict(**_IM, function=("{{content}}<|im_end|>\n",),
             observation=("<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n",),
             tool_format="qwen", stop_words=("<|im_end|>",), replace_eos=True)
_GEMMA = dict(user=("<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n",),
              assistant=("{{content}}<end_of_turn>\n",), system=("{{content}}\n\n",),
              observation=("<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n",),
              prefix=(BOS,), system_in_user=True)
_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                  "The assistant gives helpful, detailed, and polite answers to the user's questions.")
_LLAMA3 = dict(
    user=("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n",),
    assistant=("{{content}}<|eot_id|>",),
    system=("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>",),
    function=("{{content}}<|eot_id|>",),
    observation=("<|start_header_id|>ipython<|end_header_id|>\n\n{{content}}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",),
    tool_format="llama3", prefix=(BOS,), stop_words=("<|eot_id|>", "<|eom_id|>"), replace_eos=True)

_ALL = [
    _define("default", user=("Human: {{content}}", EOS, "\nAssistant:"), assistant=("{{content}}", EOS, "\n"),
            system=("System: {{content}}", EOS, "\n"), replace_jinja=True),
    _define("empty", assistant=(CONTENT,)),
    _define("alpaca", user=("### Instruction:\n{{content}}\n\n### Response:\n",),
            assistant=("{{content}}", EOS, "\n\n"),
            default_system="Below is an instruction that describes a task. Write a response that appropriately "
                           "completes the request.\n\n", replace_jinja=True),
    _define("vicuna", user=("USER: {{content}} ASSISTANT:",), default_system=_VICUNA_SYSTEM, replace_jinja=True),
    _define("llava", user=("USER: {{content}} ASSISTANT:",), default_system=_VICUNA_SYSTEM),
    _define("llava_next", user=("USER: {{content}} ASSISTANT:",), default_system=_VICUNA_SYSTEM),
    _define("chatml", **_IM, observation=("<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
            stop_words=("<|im_end|>", "<|im_start|>"), replace_eos=True, replace_jinja=True),
    _define("qwen", **_QWEN, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    _define("qwen2_vl", **_QWEN, default_system="You are a helpful assistant."),
    _define("qwen3", **_QWEN, reasoning=True),
    _define("qwen3_nothink", **_QWEN),
    _define("qwen3_vl", **_QWEN, reasoning=True),
    _define("qwen3_vl_nothink", **_QWEN),
    _define("qwen3_5", **{**_QWEN, "tool_format": "qwen3_5"}, reasoning=True),
    _define("qwen3_5_nothink", **{**_QWEN, "tool_format": "qwen3_5"}),
    _define("yi", **_IM, stop_words=("<|im_end|>",)),
    _define("smollm", **_IM, stop_words=("<|im_end|>",)),
    _define("smollm2", **_IM, stop_words=("<|im_end|>",),
            default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face."),
    _define("cpm4", **_IM, observation=("<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
            prefix=(BOS,), stop_words=("<|im_end|>",)),
    _define("llama2", user=(BOS, "[INST] {{content}} [/INST]"), system=("<<SYS>>\n{{content}}\n<</SYS>>\n\n",),
            system_in_user=True),
    _define("llama3", **_LLAMA3),
    _define("llama4", user=("<|header_start|>user<|header_end|>\n\n{{content}}<|eot|>"
                            "<|header_start|>assistant<|header_end|>\n\n",),
            assistant=("{{content}}<|eot|>",), system=("<|header_start|>system<|header_end|>\n\n{{content}}<|eot|>",),
            function=("{{content}}<|eot|>",),
            observation=("<|header_start|>ipython<|header_end|>\n\n{{content}}<|eot|>"
                         "<|header_start|>assistant<|header_end|>\n\n",),
            tool_format="llama3", prefix=(BOS,), stop_words=("<|eot|>", "<|eom|>"), replace_eos=True),
    _define("mistral", user=("[INST] {{content}}[/INST]",), assistant=(" {{content}}", EOS),
            system=("{{content}}\n\n",), function=("[TOOL_CALLS] {{content}}", EOS),
            observation=('[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]',), tool_format="mistral",
            prefix=(BOS,), system_in_user=True),
    _define("ministral", user=("[INST]{{content}}[/INST]",), system=("{{content}}\n\n",),
            function=("[TOOL_CALLS]{{content}}", EOS),
            observation=('[TOOL_RESULTS]{"content": {{content}}}[/TOOL_RESULTS]',), tool_format="mistral",
            prefix=(BOS,), system_in_user=True),
    _define("mistral_small", user=("[INST]{{content}}[/INST]",), system=("[SYSTEM_PROMPT]{{content}}[/SYSTEM_PROMPT]",),
            function=("[TOOL_CALLS]{{content}}", EOS),
            observation=('[TOOL_RESULTS]{"content": {{content}}}[/TOOL_RESULTS]',), tool_format="mistral",
            prefix=(BOS,)),
    _define("gemma", **_GEMMA, stop_words=("<end_of_turn>",), replace_eos=True),
    _define("gemma2", **_GEMMA, stop_words=("<eos>", "<end_of_turn>"), efficient_eos=True),
    _define("gemma3", **_GEMMA, stop_words=("<end_of_turn>",), replace_eos=True),
    _define("phi", user=("<|user|>\n{{content}}<|end|>\n<|assistant|>\n",), assistant=("{{content}}<|end|>\n",),
            system=("<|system|>\n{{content}}<|end|>\n",), stop_words=("<|end|>",), replace_eos=True),
    _define("phi4", user=("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>",),
            assistant=("{{content}}<|im_end|>",), system=("<|im_start|>system<|im_sep|>{{content}}<|im_end|>",),
            stop_words=("<|im_end|>",), replace_eos=True),
    _define("phi4_mini", user=("<|user|>{{content}}<|end|><|assistant|>",), assistant=("{{content}}<|end|>",),
            system=("<|system|>{{content}}<|end|>",), tools_slot=("<|tool|>{{content}}<|/tool|>",),
            stop_words=("<|end|>",), replace_eos=True),
    _define("deepseek", user=("User: {{content}}\n\nAssistant:",), system=("{{content}}\n\n",), prefix=(BOS,)),
    _define("deepseek3", user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,)),
    _define("deepseekr1", user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,), reasoning=True),
    _define("glm4", user=("<|user|>\n{{content}}<|assistant|>",), assistant=("\n{{content}}",),
            system=("<|system|>\n{{content}}",), function=(CONTENT,),
            observation=("<|observation|>\n{{content}}<|assistant|>",), tool_format="glm4", prefix=("[gMASK]<sop>",),
            stop_words=("<|user|>", "<|observation|>"), efficient_eos=True),
    _define("glm4_moe", user=("<|user|>\n{{content}}<|assistant|>",), assistant=("\n{{content}}",),
            system=("<|system|>\n{{content}}",), function=(CONTENT,),
            observation=("<|observation|>\n{{content}}<|assistant|>",), tool_format="glm4_moe",
            prefix=("[gMASK]<sop>",), stop_words=("<|user|>", "<|observation|>"), efficient_eos=True, reasoning=True),
    _define("gpt_oss", user=("<|start|>user<|message|>{{content}}<|end|><|start|>assistant",), assistant=(CONTENT,),
            system=("<|start|>system<|message|>{{content}}<|end|>",),
            default_system="You are ChatGPT, a large language model trained by OpenAI.",
            thought_words=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
            efficient_eos=True, reasoning=True),
    _define("zephyr", user=("<|user|>\n{{content}}", EOS, "<|assistant|>\n"), system=("<|system|>\n{{content}}", EOS),
            default_system="You are Zephyr, a helpful assistant."),
    _define("olmo", user=("<|user|>\n{{content}}<|assistant|>\n",), prefix=(EOS,)),
    _define("granite3", user=("<|start_of_role|>user<|end_of_role|>{{content}}<|end_of_text|>\n"
                              "<|start_of_role|>assistant<|end_of_role|>",),
            assistant=("{{content}}<|end_of_text|>\n",),
            system=("<|start_of_role|>system<|end_of_role|>{{content}}<|end_of_text|>\n",)),
    _define("falcon", user=("User: {{content}}\nFalcon:",), assistant=("{{content}}\n",), efficient_eos=True),
]
TEMPLATES: dict[str, Template] = {t.name: t for t in _ALL}


def get_template(name: str) -> Template:
    """The LLaMA-Factory template called `name`; a DataError lists the valid names."""
    if name not in TEMPLATES:
        raise DataError(f"template={name!r} is not a LLaMA-Factory template megatrain renders; use one of "
                            f"{', '.join(sorted(TEMPLATES))}, or leave it unset for the tokenizer's own chat_template.")
    return TEMPLATES[name]
