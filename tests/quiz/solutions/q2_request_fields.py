"""练习 q2 的参考实现：聊天请求的各个字段去了哪里。

约定：
- `tokenize_msg(req, uid, tools)` 是 /v1/chat/completions 为 `req`、以 `uid` 发给
  Tokenizer Worker 的 TokenizeMsg：作为聊天模板输入的对话消息（`{"role", "content"}`，
  文本分段拼接，"developer" 改称 "system"）；模板展示给模型的工具（tool_choice 为
  "none" 时没有）；`SamplingParams` 里的每个采样参数（`max_tokens` 或
  `max_completion_tokens` 作为 `max_tokens`；强制的工具调用作为语法，由 `tools`，
  也就是这个请求的工具调用格式写出）；以及聊天模板怎样渲染这些消息
  （`add_generation_prompt`、`continue_final_message`、模板的额外变量）。
- `frontend_only_fields()` 列出永远到不了 worker 的请求字段：改动其中任何一个，
  API Server 发出的消息都不会变。
"""

from __future__ import annotations

from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest


# --8<-- [start:tokenize_msg]
def tokenize_msg(req: ChatCompletionRequest, uid: int, tools) -> TokenizeMsg:
    messages = [m.as_template_input() for m in req.messages]  # 聊天模板的输入
    return TokenizeMsg(
        uid,
        req.sampling_params(tools),
        messages=messages,
        tools=req.template_tools(),
        # 模板怎样渲染它们（reasoning_effort 也在模板变量之中）
        add_generation_prompt=req.generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.template_kwargs(),
    )


# --8<-- [end:tokenize_msg]


def frontend_only_fields() -> set[str]:
    return {
        "model",  # 与服务的模型名比较：不一致就是 404
        "stream",  # 选择 StreamResponse 或 FullResponse
        "stream_options",  # include_usage：流的末尾多一个数据块
        "user",  # 只随请求记进日志
        "response_format",  # {"type": "text"} 什么也不要求（schema 才会约束生成）
        # OpenAI 为托管服务定义的字段（存储、计费、缓存、路由用）：接受它们，
        # 好让会发这些字段的客户端能用，然后忽略
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "verbosity",
        "prediction",
        "modalities",  # ["text"]：本来就只生成文本（要音频会被拒绝）
        "audio",  # 只接受 null
    }
