"""Loading a custom handler file: the one handler class it defines, or the one the manifest
names; a function entry point, a missing or ambiguous class, an abstract class, an import error
and a failing constructor are refused with a message saying which."""

from __future__ import annotations

import pytest

from pagedserve.handlers import LLMHandler
from pagedserve.handlers.custom_handler import CustomHandlerError, load_custom_handler

ONE_CLASS = """
from pagedserve.handlers import LLMHandler
from helper_words import WORD

class Shouting(LLMHandler):
    word = WORD
"""


def write(tmp_path, text: str, name: str = "my_handler.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_only_handler_class_is_loaded_with_its_folder_importable(tmp_path):
    write(tmp_path, "WORD = 'loud'\n", "helper_words.py")  # an --extra-files module
    handler = load_custom_handler(write(tmp_path, ONE_CLASS), "my_handler")
    assert isinstance(handler, LLMHandler) and type(handler).__name__ == "Shouting"
    assert handler.word == "loud" and not handler.initialized
    assert str(tmp_path) not in __import__("sys").path  # the folder is on sys.path only while importing


def test_the_named_class_among_several(tmp_path):
    path = write(
        tmp_path, "from pagedserve.handlers import LLMHandler\nclass A(LLMHandler): pass\nclass B(LLMHandler): pass\n"
    )
    assert type(load_custom_handler(path, "my_handler:B")).__name__ == "B"
    with pytest.raises(CustomHandlerError, match=r"several handler classes \(A, B\).*my_handler:A"):
        load_custom_handler(path, "my_handler")
    with pytest.raises(CustomHandlerError, match="defines no 'C'"):
        load_custom_handler(path, "my_handler:C")


def test_two_files_of_the_same_name_stay_apart(tmp_path):
    paths = {}
    for tag in ("a", "b"):
        (tmp_path / tag).mkdir()
        paths[tag] = write(
            tmp_path / tag, f"from pagedserve.handlers import LLMHandler\nclass H(LLMHandler): tag = {tag!r}\n"
        )
    assert load_custom_handler(paths["a"], "my_handler").tag == "a"
    assert load_custom_handler(paths["b"], "my_handler").tag == "b"


@pytest.mark.parametrize(
    "text, spec, message",
    [
        (
            "def handle(data, context):\n    return data\n",
            "my_handler",
            "defines no handler class.*handle\\(data, context\\)",
        ),
        (
            "def handle(data, context):\n    return data\n",
            "my_handler:handle",
            "not a handler class.*function entry point",
        ),
        (
            "from pagedserve.handlers import BaseHandler\nclass Half(BaseHandler):\n    def preprocess(self, r): return r\n",
            "my_handler:Half",
            "Half leaves postprocess abstract",
        ),
        ("import no_such_module_here\n", "my_handler", "failed to import: ModuleNotFoundError"),
        (
            "from pagedserve.handlers import LLMHandler\nclass Bad(LLMHandler):\n    def __init__(self):\n        raise OSError('no gpu')\n",
            "my_handler",
            r"Bad\(\) failed: OSError: no gpu",
        ),
    ],
)
def test_refusals_say_why(tmp_path, text, spec, message):
    with pytest.raises(CustomHandlerError, match=message):
        load_custom_handler(write(tmp_path, text), spec)
