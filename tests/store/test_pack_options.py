"""pack's less common settings travel whole in one PackOptions: checked where they are written,
each old flat keyword moved into it once at the door (with the house DeprecationWarning), and
read from the object where they are used."""

import ast
import importlib
import inspect
import pathlib
import warnings

import pytest

import stoker
from _helpers import make_image_folder
from stoker import PackOptions, open_dataset, pack
from stoker.store.pack_options import DEPRECATED, resolve

STORE = pathlib.Path(stoker.__file__).parent / "store"
pack_mod = importlib.import_module("stoker.store.pack")  # the module: stoker.store.pack is the function


def _tree(root):
    return make_image_folder(root, {f"c{i % 2}/img{i}.jpg": bytes([i]) * 700 for i in range(6)})


def test_pack_takes_at_most_ten_parameters():
    params = inspect.signature(pack).parameters.values()
    assert len([p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]) <= 10


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_each_old_keyword_moves_into_the_group_with_one_warning(old):
    value = {"read_workers": 3, "shuffle_seed": 7, "lease_s": 30.0, "column": "c", "key_column": "k"}.get(old, {"a": 1})
    with pytest.warns(DeprecationWarning, match=rf"^{old}= is deprecated; use options=PackOptions\({DEPRECATED[old]}="):
        got = resolve(None, {old: value}, None)
    assert getattr(got, DEPRECATED[old]) == value


def test_conflicts_raise_before_any_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="read_workers= and options= were both given"):
            resolve(PackOptions(), {"read_workers": 2}, None)
        with pytest.raises(TypeError, match="unexpected keyword argument 'workers'"):
            resolve(None, {"workers": 2}, None)
        with pytest.raises(ValueError, match="src_options= and src_storage_options= both set"):
            resolve(None, {"src_options": {}, "src_storage_options": {}}, None)
        with pytest.raises(TypeError, match="options must be a PackOptions, got dict"):
            resolve({"read_workers": 2}, {}, None)  # type: ignore[arg-type]


def test_each_side_takes_its_own_storage_options_else_the_shared_ones():
    both = {"anon": True}
    got = resolve(PackOptions(dst_storage_options={"profile": "w"}), {}, both)
    assert got.src_storage_options == both and got.dst_storage_options == {"profile": "w"}
    assert resolve(None, {}, None).src_storage_options == {}


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"read_workers": 0}, ValueError, "read_workers must be >= 1"),
        ({"read_workers": "4"}, TypeError, "read_workers must be an integer"),
        ({"shuffle_seed": 1.5}, TypeError, "shuffle_seed must be an integer or None"),
        ({"lease_s": 0}, ValueError, "lease_s must be a number of seconds > 0"),
        ({"column": 3}, TypeError, "column must be a column name"),
        ({"src_storage_options": "anon"}, TypeError, "src_storage_options must be a dict"),
    ],
)
def test_a_bad_field_fails_where_it_is_written(fields, error, match):
    with pytest.raises(error, match=rf"PackOptions\.{match}"):
        PackOptions(**fields)


def test_the_group_keeps_its_own_copy_of_a_dict():
    opts = {"anon": True}
    group = PackOptions(src_storage_options=opts)
    opts["anon"] = False
    assert group.src_storage_options == {"anon": True}


def test_read_workers_reaches_the_reader_threads_from_the_object(tmp_path, monkeypatch):
    """The walk of ``PackOptions.read_workers``: given once, in the object, and read where the
    source's reader threads are made."""
    made = []
    real = pack_mod.ThreadPoolExecutor

    def pool(n, *a, **k):
        made.append(n)
        return real(n, *a, **k)

    monkeypatch.setattr(pack_mod, "ThreadPoolExecutor", pool)
    r = pack(str(_tree(tmp_path / "src")), str(tmp_path / "d"), options=PackOptions(read_workers=3, shuffle_seed=None))
    assert 3 in made and r.samples == 6
    assert open_dataset(str(tmp_path / "d"), cache=False).key(0) == "c0/img0"


def test_an_old_keyword_still_packs(tmp_path):
    with pytest.warns(DeprecationWarning, match="^read_workers= is deprecated"):
        r = pack(str(_tree(tmp_path / "src")), str(tmp_path / "d"), read_workers=2)
    assert r.samples == 6


def test_the_settings_are_read_only_from_the_group():
    """In the store, a PackOptions field is read as an attribute of the object it travels in
    (``options.x``), never copied into another object's attribute on the way (a method of the same
    name, such as pyarrow's ``table.column()``, is not one)."""
    fields = set(PackOptions.__dataclass_fields__)
    stray = []
    for path in sorted(STORE.glob("*.py")):
        tree = ast.parse(path.read_text())
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in fields and id(node) not in called:
                owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
                if owner not in ("options", "self") or isinstance(node.ctx, ast.Store):
                    stray.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert stray == []


def test_a_path_object_packs_and_a_parquet_only_column_is_refused_elsewhere(tmp_path):
    src = _tree(tmp_path / "src")
    assert pack(pathlib.Path(src), tmp_path / "d").samples == 6  # pathlib.Path on both sides: local paths
    with pytest.raises(ValueError, match=r"PackOptions\.key_column .*source='parquet'"):
        pack(str(src), str(tmp_path / "d2"), options=PackOptions(key_column="k"))
