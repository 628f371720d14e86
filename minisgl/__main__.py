"""`python -m minisgl`: serve a model, or with --prompt generate once and stream to stdout;
`python -m minisgl doctor` checks the CUDA fast path on this machine (minisgl/doctor)."""

from __future__ import annotations

import logging
import sys

from minisgl.server.args import ServerArgs, parse_args


def run_prompt(args: ServerArgs) -> int:
    from minisgl import LLM, SamplingParams

    llm = LLM(engine_config=args.engine_config, scheduler_config=args.scheduler_config)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = messages if llm.tokenizer.chat_template else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens or 256)
    for event in llm.stream([prompt], params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if event.output.finished:
            end = event.output.finish_reason or f"error: {event.output.error}"
            sys.stdout.write(f"\n[{len(event.output.token_ids)} tokens, finish_reason: {end}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from minisgl.doctor import main as doctor

        return doctor(argv[1:])
    args = parse_args(argv)
    if args.shell and args.log_level == "info":
        args.log_level = "warning"  # worker start-up lines would clutter the conversation
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from minisgl.models.default_model import DefaultModelMissing

    try:
        if args.prompt is not None:
            return run_prompt(args)
        if args.shell:
            from minisgl.shell import launch_shell

            return launch_shell(args)
        from minisgl.server.launch import launch_server

        return launch_server(args)
    except DefaultModelMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
