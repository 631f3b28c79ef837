import pytest

from la_compiler.passes.module_names import normalize_module_path


@pytest.mark.parametrize("path, expected", [
    ("L['self'].layers[0].attn", "layers.0.attn"),
    ("getattr(L['self'].layers, '0').attn", "layers.0.attn"),
    ("L['self']._modules['layers']['3']._modules['self_attn']", "layers.3.self_attn"),
    ("L['model'].blocks[12].mixer", "blocks.12.mixer"),
    ("L['self']", ""),
    ("L['args'][0].model.layers.1.attn", "model.layers.1.attn"),  # a wrapped forward(*args)
    ("L['kwargs']['model'].layers[2]", "layers.2"),
])
def test_normalize_module_path(path, expected):
    assert normalize_module_path(path) == expected
