"""练习 q2（测验第 2 题）：messages、max_tokens 和 stream 去了哪里。

任务：为 /v1/chat/completions 写下面两个函数。
- `tokenize_msg(req, uid, tools)`：API Server 为解析好的请求 `req`、以 `uid` 发给
  Tokenizer Worker 的 TokenizeMsg。测试拿很多个请求，把它和真实路由
  （minisgl/server/chat.py 里的 `v1_chat_completions`）发出的消息比较。`tools` 是
  这个请求的工具调用格式（没有工具时为 None），和真实路由一样从服务的输出解析器
  取得：强制的工具调用，由它写出语法。
- `frontend_only_fields()`：`ChatCompletionRequest` 里永远到不了 worker 的字段名，
  也就是改动其中任何一个，都不会改变任何消息。测试逐个改变请求模型的每个字段，
  以此核对你给出的集合。

提示：
- Tokenizer Worker 套用模型的聊天模板；聊天模板的输入是什么？
- `ChatMessage`（minisgl/server/conversation.py）知道怎样变成这种输入；请求也知道
  模板要把它的哪些工具展示给模型。
- 请求模型已经知道怎样构造自己的 `SamplingParams`：找到那个方法，
  看它怎样处理 `max_tokens` 和 `max_completion_tokens`。
- `TokenizeMsg`（minisgl/message/tokenizer.py）里没有表示流式的字段：
  那么 `stream` 在哪里起作用？其他不是采样参数的字段呢？
- 第 2.3 节的折叠里有一张表列出了几个字段的去向，但没有列全（写完再看）。

检查：pytest tests/quiz --learner -m q2
"""

from __future__ import annotations

from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest

TODO = (
    "练习 q2：编辑 tests/quiz/exercises/q2_request_fields.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q2"
)


def tokenize_msg(req: ChatCompletionRequest, uid: int, tools) -> TokenizeMsg:
    raise NotImplementedError(TODO)


def frontend_only_fields() -> set[str]:
    raise NotImplementedError(TODO)
