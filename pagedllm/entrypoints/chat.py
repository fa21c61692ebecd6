"""``pagedllm chat``: an interactive terminal chat that streams tokens as they are generated.

Models with a chat template get the conversation so far through it; a model without one (the
bundled demo model) runs in plain-continuation mode: each line is continued as text.
"""
from __future__ import annotations

import argparse
import sys

from pagedllm.engine.arg_utils import add_engine_args, engine_args_from_cli
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import add_sampling_args, sampling_params_from_cli

CHAT_EXAMPLES = """examples:
  pagedllm chat                                  # bundled demo model, plain continuation
  pagedllm chat --model Qwen/Qwen2.5-0.5B-Instruct --system "You are terse."
  echo "And God said" | pagedllm chat --max-tokens 40
Type /exit or press Ctrl-D to quit, /reset to start a new conversation.
"""


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help="interactive chat in the terminal (streams tokens)",
                                   epilog=CHAT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default=None, help="system prompt (chat-template models)")
    add_engine_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(func=run)
    return parser


class ChatSession:
    """Keeps the conversation and streams one reply at a time from an LLMEngine."""

    def __init__(self, engine, params, system: str | None = None, out=sys.stdout):
        self.engine, self.params, self.out = engine, params, out
        self.system = system
        self.templated = bool(getattr(engine.tokenizer, "chat_template", None))
        self.messages: list[dict] = []
        self._turn = 0

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system and self.templated else []

    def prompt_ids(self, user_text: str) -> list[int]:
        tok = self.engine.tokenizer
        if not self.templated:
            return tok.encode(user_text)
        self.messages.append({"role": "user", "content": user_text})
        ids = tok.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def reply(self, user_text: str) -> str:
        """Streams the model's reply to ``out`` and returns it."""
        rid = f"chat-{self._turn}"
        self._turn += 1
        params = self.params.clone()
        params.output_kind = "delta"
        self.engine.add_request(rid, {"prompt_token_ids": self.prompt_ids(user_text)}, params)
        text = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                delta = out.outputs[0].text if out.outputs else ""
                text.append(delta)
                self.out.write(delta)
                self.out.flush()
        self.out.write("\n")
        reply = "".join(text)
        if self.templated:
            self.messages.append({"role": "assistant", "content": reply})
        return reply


def run(args) -> int:
    engine = LLMEngine.from_engine_args(engine_args_from_cli(args))
    params = sampling_params_from_cli(args, dict(engine.model_config.generation_defaults))
    session = ChatSession(engine, params, args.system)
    session.reset()
    mode = "chat template" if session.templated else "plain continuation (no chat template)"
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"pagedllm chat: {args.model} [{mode}]. /exit or Ctrl-D quits, /reset clears.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            continue
        if line:
            if not session.templated:
                sys.stdout.write(line)
            session.reply(line)
    return 0
