"""Tool-calling text in LLaMA-Factory's formats: the tool list for the system prompt, and an
assistant's function call.

A data set's `tools` column holds the tool schemas (a JSON string, as in LLaMA-Factory's
glaive_toolcall demo, or the list itself); a `function_call` turn holds the call as JSON,
``{"name": "f", "arguments": {...}}`` or a list of them. Both become text in one of
LLaMA-Factory's tool formats, byte for byte:

    >>> describe_tools('[{"name": "f", "description": "d", "parameters": {"properties": {}}}]', "qwen")
    '\\n\\n# Tools\\n\\nYou may call one or more functions ... <tools>\\n{"type": "function", ...'
    >>> format_calls('{"name": "f", "arguments": {"x": 1}}', "qwen", ("<think>\\n", "\\n</think>\\n\\n"), None)
    '<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
"""
from __future__ import annotations

import json
import re
from datetime import datetime

from .registry import DataError

_DEFAULT_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)
_GLM4_PROMPT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}"
)
_LLAMA3_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    """Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. """
    "Do not use variables.\n\n{tool_text}"
)
_QWEN_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)
_QWEN35_PROMPT = (
    "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>{tool_text}"
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: "
    "an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
_GLM4_MOE_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:"
    "\n<tool_call>{{function-name}}"
    "\n<arg_key>{{arg-key-1}}</arg_key>"
    "\n<arg_value>{{arg-value-1}}</arg_value>"
    "\n<arg_key>{{arg-key-2}}</arg_key>"
    "\n<arg_value>{{arg-value-2}}</arg_value>"
    "\n...\n</tool_call>\n"
)
FORMATS = ("default", "glm4", "glm4_moe", "llama3", "mistral", "qwen", "qwen3_5")


def _dumps(value, indent=None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _function(tool: dict) -> dict:
    """The schema itself, whether given bare or OpenAI-style as {"type": "function", "function": ...}."""
    return tool.get("function", "") if tool.get("type") == "function" else tool


def _wrapped(tool: dict) -> dict:
    """The OpenAI-style {"type": "function", "function": schema} form."""
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _default_tools(tools: list[dict]) -> str:
    blocks, names = [], []
    for tool in map(_function, tools):
        params = tool["parameters"]
        lines = []
        for name, p in params["properties"].items():
            required = ", required" if name in params.get("required", []) else ""
            enum = f", should be one of [{', '.join(p['enum'])}]" if p.get("enum", None) else ""
            items = f", where each item should be {p['items'].get('type', '')}" if p.get("items", None) else ""
            lines.append(f"  - {name} ({p.get('type', '')}{required}): {p.get('description', '')}{enum}{items}\n")
        blocks.append(f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\n"
                      f"Tool Args:\n{''.join(lines)}\n")
        names.append(tool["name"])
    return _DEFAULT_PROMPT.format(tool_text="".join(blocks), tool_names=", ".join(names))


def _glm4_tools(tools: list[dict]) -> str:
    text = "".join(f"\n\n## {t['name']}\n\n{_dumps(t, 4)}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
                   for t in map(_function, tools))
    return _GLM4_PROMPT.format(tool_text=text)


def _llama3_tools(tools: list[dict]) -> str:
    # today's date, as LLaMA-Factory renders it: the same data encodes differently on another day
    text = "".join(_dumps(_wrapped(t), 4) + "\n\n" for t in tools)
    return _LLAMA3_PROMPT.format(date=datetime.now().strftime("%d %b %Y"), tool_text=text)


def _mistral_tools(tools: list[dict]) -> str:
    return "[AVAILABLE_TOOLS] " + _dumps([_wrapped(t) for t in tools]) + "[/AVAILABLE_TOOLS]"


def _qwen_tools(tools: list[dict]) -> str:
    return _QWEN_PROMPT.format(tool_text="".join("\n" + _dumps(_wrapped(t)) for t in tools))


def _qwen35_tools(tools: list[dict]) -> str:
    # the bare schema (a wrapper without "function" keeps itself, unlike _function)
    return _QWEN35_PROMPT.format(tool_text="".join(
        "\n" + _dumps(t.get("function", t) if t.get("type") == "function" else t) for t in tools))


def _glm4_moe_tools(tools: list[dict]) -> str:
    return _GLM4_MOE_PROMPT.format(tool_text="".join("\n" + _dumps(_wrapped(t)) for t in tools))


_TOOLS = {"default": _default_tools, "glm4": _glm4_tools, "glm4_moe": _glm4_moe_tools, "llama3": _llama3_tools,
          "mistral": _mistral_tools, "qwen": _qwen_tools, "qwen3_5": _qwen35_tools}


def _default_calls(calls: list[tuple[str, str]]) -> str:
    return "\n".join(f"Action: {name}\nAction Input: {args}" for name, args in calls)


def _glm4_calls(calls: list[tuple[str, str]]) -> str:
    if len(calls) > 1:
        raise DataError("tool_format glm4 has no parallel function calls: a function_call turn lists "
                        f"{len(calls)} calls; split it into one call per turn or use another tool_format.")
    return f"{calls[0][0]}\n{calls[0][1]}"


def _llama3_calls(calls: list[tuple[str, str]]) -> str:
    objects = [{"name": name, "parameters": json.loads(args)} for name, args in calls]
    return _dumps(objects[0] if len(objects) == 1 else objects)


def _mistral_calls(calls: list[tuple[str, str]]) -> str:
    return _dumps([{"name": name, "arguments": json.loads(args)} for name, args in calls])


def _qwen_calls(calls: list[tuple[str, str]]) -> str:
    return "\n".join("<tool_call>\n" + _dumps({"name": name, "arguments": json.loads(args)}) + "\n</tool_call>"
                     for name, args in calls)


def _text_value(value) -> str:
    """An argument's value as XML-ish formats print it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else _dumps(value)


def _qwen35_calls(calls: list[tuple[str, str]]) -> str:
    return "\n".join(f"<tool_call>\n<function={name}>"
                     + "".join(f"\n<parameter={k}>\n{_text_value(v)}\n</parameter>"
                               for k, v in json.loads(args).items())
                     + "\n</function>\n</tool_call>" for name, args in calls)


def _glm4_moe_calls(calls: list[tuple[str, str]]) -> str:
    # no closing </tool_call>: LLaMA-Factory writes none
    return "\n".join("\n<tool_call>" + name
                     + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{_text_value(v)}</arg_value>"
                               for k, v in json.loads(args).items()) for name, args in calls)


_CALLS = {"default": _default_calls, "glm4": _glm4_calls, "glm4_moe": _glm4_moe_calls, "llama3": _llama3_calls,
          "mistral": _mistral_calls, "qwen": _qwen_calls, "qwen3_5": _qwen35_calls}


def check_format(tool_format: str) -> None:
    """A DataError unless megatrain renders `tool_format` exactly as LLaMA-Factory does."""
    if tool_format not in FORMATS:
        raise DataError(f"tool_format={tool_format!r}: megatrain renders LLaMA-Factory's {', '.join(FORMATS)} tool "
                        "formats; use one of them or leave tool_format unset for the template's own.")


def describe_tools(tools, tool_format: str) -> str:
    """The tool list's text for the system prompt ("" for an empty list)."""
    check_format(tool_format)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise DataError(f"the tools column must hold a JSON list of tool schemas, not {tools!r:.120}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"the tools column must hold a JSON list of tool schemas (objects), not {tools!r:.120}")
    if not tools:
        return ""
    try:
        return _TOOLS[tool_format](tools)
    except (KeyError, AttributeError, TypeError) as e:
        raise DataError(f"a tool schema lacks {e} for tool_format {tool_format}: each tool needs a name and "
                        f"parameters.properties: {tools!r:.160}") from None


def _parse_calls(text: str) -> list[tuple[str, str]]:
    try:
        calls = json.loads(text)
        calls = calls if isinstance(calls, list) else [calls]
        return [(c["name"], _dumps(c["arguments"])) for c in calls]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError('a function_call turn must hold JSON {"name": ..., "arguments": {...}} (or a list of them), '
                        f"not {text!r:.160}") from None


def format_calls(content: str, tool_format: str, thought_words: tuple[str, str] | None,
                 tool_call_words: tuple[str, str] | None) -> str:
    """A function_call turn's text. A call wrapped in `tool_call_words` (<tool_call>...</tool_call>)
    keeps the text around it; otherwise a thought block (`thought_words`) is kept in front."""
    check_format(tool_format)
    if tool_call_words:
        wrapped = re.search(f"{re.escape(tool_call_words[0])}(.*?){re.escape(tool_call_words[1])}", content, re.DOTALL)
        if wrapped:
            return content.replace(wrapped.group(0), "") + _CALLS[tool_format](_parse_calls(wrapped.group(1)))
    thought = None
    if thought_words:
        thought = re.search(f"{re.escape(thought_words[0])}(.*?){re.escape(thought_words[1])}", content, re.DOTALL)
    if thought:
        return thought.group(0) + _CALLS[tool_format](_parse_calls(content.replace(thought.group(0), "")))
    return _CALLS[tool_format](_parse_calls(content))
