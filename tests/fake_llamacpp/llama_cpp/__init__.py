"""A stand-in for llama-cpp-python in tests of ``throughput.py --compare-llamacpp``: the
worker's protocol and the pairing, without building llama.cpp. Its "greedy" token after a
context is the context's last token + 1 (mod 512)."""
__version__ = "fake"


def llama_print_system_info() -> bytes:
    return b"fake llama.cpp"


class Llama:
    def __init__(self, model_path: str, **kwargs):
        with open(model_path):  # the GGUF must exist
            pass

    def reset(self) -> None:
        pass

    def generate(self, tokens, **kwargs):
        last = tokens[-1]
        while True:
            last = (last + 1) % 512
            yield last
