"""Request timelines: what happened to each request in each of the three processes, and
when (GET /debug/requests, the live page GET /debug, and the metrics built from them).

A seam package: the core only calls its components' observer hooks (minisgl/observe.py),
and the observers here turn them into events. `events` holds the event kinds and the
`TimelineMsg` batches the workers send on; `scheduler` the scheduler's observer (queue,
prefill chunks, first token, preemptions, decode progress, the end with its times);
`tokenizer` the tokenizer worker's (which also passes the scheduler's batches on); `api`
the API server's store of every request's timeline and its observer. Nothing is imported
here, so the message package can import `events` alone.
"""
