"""deepfreeze.jsonsafe: JSON size and nesting bounded before parsing (issue 32)."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from deepfreeze.errors import CorruptCheckpointError, StreamError
from deepfreeze.jsonsafe import json_depth, loads

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\u00e9'),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(alphabet='[{"\\x'), kids,
                                                                               max_size=4), max_leaves=40)


def _depth(v):
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(_JSON)
def test_depth_of_valid_json_is_exact(v):
    """Brackets inside strings (escaped quotes and backslashes included) are not counted."""
    assert json_depth(json.dumps(v).encode()) == _depth(v)
    assert json_depth(json.dumps(v, ensure_ascii=False).encode()) == _depth(v)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet='[]{}"\\, 1a').map(str.encode))
def test_any_bytes_parse_or_refuse_with_the_callers_error(raw):
    try:
        loads(raw, "fuzz", max_bytes=150, max_depth=8, error=StreamError)
    except StreamError:
        pass


def test_nesting_refused_before_parsing_and_limits_named():
    with pytest.raises(CorruptCheckpointError, match=r"ring meta: JSON nested deeper than 32 levels; .*remove"):
        loads(b"[" * 1_000_000, "ring meta", max_bytes=1 << 21)
    assert loads(b"[" * 32 + b"]" * 32, "x", max_bytes=100) == loads(b"[" * 32 + b"]" * 32, "x", max_bytes=100)
    with pytest.raises(CorruptCheckpointError, match="larger than the 10-byte limit"):
        loads(b"[1, 2, 3, 4, 5]", "x", max_bytes=10)
    with pytest.raises(CorruptCheckpointError, match="a JSON list where a JSON object was expected"):
        loads(b"[]", "x", max_bytes=10, kind=dict)
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        loads(b"\xff", "x", max_bytes=10)
    assert json_depth(b'"\\"[[[" [') == 1  # an escaped quote does not end the string


def _depth_by_regex(data: bytes) -> int:
    """json_depth's second way alone (every string removed by its regular expression)."""
    from itertools import accumulate
    from deepfreeze.jsonsafe import _NOT_BRACKETS, _STRING
    if b"[" not in data and b"{" not in data:
        return 0
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(1 if b in b"[{" else -1 for b in brackets), default=0)


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(st.text(alphabet='[]{}"a ,').map(str.encode) | st.text(alphabet='[]{}"\\a').map(str.encode)
       | st.binary(max_size=100))
def test_depth_without_the_regex_is_the_same(raw):
    """The first way (no backslash: quotes and brackets only, ``""`` pairs removed) gives what the
    regular expression gives, on any bytes: strings holding brackets, unterminated strings,
    unbalanced brackets."""
    assert json_depth(raw) == _depth_by_regex(raw)
    for b in (b'["[", "]"]', b'[""""]', b'"[""]"', b'[["', b'"a"[[]]"b"', b'""[', b'"]"[['):
        assert json_depth(b) == _depth_by_regex(b), b
