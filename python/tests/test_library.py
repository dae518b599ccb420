"""How the package finds, loads and checks the shared library, its packaging, and the C API's
structs against ringattn.h."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import ringattn
from ringattn import _capi

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parent
HEADER = REPO / "include" / "ringattn" / "ringattn.h"


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(_capi.LIBRARY_ENV, raising=False)


def fake_library(tmp_path, version_code, version_string, without=()):
    """A shared library with the C API's entry points (but those named in `without`) that
    reports the given version."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a library of another version")
    source = tmp_path / "fake.c"
    source.write_text(f"""
int ringattn_version(void) {{ return {version_code}; }}
const char* ringattn_version_string(void) {{ return "{version_string}"; }}
const char* ringattn_status_string(int s) {{ return "x"; }}
const char* ringattn_last_error(void) {{ return ""; }}
int ringattn_cuda_device_count(void) {{ return 0; }}
int ringattn_attention_forward(const void* p, void* s) {{ return 5; }}
int ringattn_attention_backward_prepare(const void* a, const void* b, const void* c, void* s) {{ return 5; }}
int ringattn_attention_backward_prepare_zero_dq(const void* a, const void* b, const void* c, const void* d, void* s) {{ return 5; }}
int ringattn_attention_backward(const void* p, void* s) {{ return 5; }}
int ringattn_ring_create(const void* c, int m, int l, void** r) {{ return 5; }}
int ringattn_nccl_unique_id(void* id, unsigned long n) {{ return 5; }}
int ringattn_ring_create_nccl(const void* id, unsigned long n, int r, int s, int l, void** o) {{ return 5; }}
int ringattn_ring_destroy(void* r) {{ return 5; }}
int ringattn_ring_forward(void* r, const void* p, void* s) {{ return 5; }}
int ringattn_ring_backward(void* r, const void* p, void* s) {{ return 5; }}
int ringattn_layout_chunks(const void* p, long* s, long* l, long c, long* n) {{ return 5; }}
""")
    source.write_text("\n".join(line for line in source.read_text().split("\n")
                                if not any(f" {name}(" in line for name in without)))
    library = tmp_path / "libringattn.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_the_library_found_matches_the_package():
    lib = ringattn.library()
    assert lib.version == ringattn.library_version()
    assert lib.version.split(".")[:2] == ringattn.__version__.split(".")[:2]
    assert lib.version_code == int(lib.version.split(".")[0]) * 10000 + \
        int(lib.version.split(".")[1]) * 100 + int(lib.version.split(".")[2])


@pytest.mark.parametrize("minor_step", [-1, 1], ids=["older_minor", "newer_minor"])
def test_version_mismatch_names_both(tmp_path, minor_step):
    """A library of another minor version, older (whose structs lack fields the package sets)
    or newer, is refused."""
    major, minor, _ = (int(x) for x in ringattn.__version__.split("."))
    other = f"{major}.{minor + minor_step}.0"
    library = fake_library(tmp_path, major * 10000 + (minor + minor_step) * 100, other)
    with pytest.raises(ringattn.RingattnError) as info:
        _capi.Library(library)
    message = str(info.value)
    assert str(library) in message
    assert f"ringattn {other}" in message and f"ringattn is {ringattn.__version__}" in message
    assert "major.minor" in message and _capi.LIBRARY_ENV in message


def test_an_older_library_without_the_newer_entry_points_is_named(tmp_path):
    """A library of the previous minor version, which lacks
    ringattn_attention_backward_prepare_zero_dq (0.7), is refused by its version, not by the
    missing symbol."""
    major, minor, _ = (int(x) for x in ringattn.__version__.split("."))
    library = fake_library(tmp_path, major * 10000 + (minor - 1) * 100, f"{major}.{minor - 1}.0",
                           without=("ringattn_attention_backward_prepare_zero_dq",))
    with pytest.raises(ringattn.RingattnError, match=f"is ringattn {major}.{minor - 1}.0 .* must "
                                                     "share major.minor"):
        _capi.Library(library)


def test_a_patch_release_of_the_same_minor_is_taken(tmp_path):
    major, minor, _ = ringattn.__version__.split(".")
    code = int(major) * 10000 + int(minor) * 100 + 7
    lib = _capi.Library(fake_library(tmp_path, code, f"{major}.{minor}.7"))
    assert lib.version == f"{major}.{minor}.7"


def test_environment_variable_wins(tmp_path, monkeypatch):
    library = fake_library(tmp_path, 300, "0.3.0")
    monkeypatch.setenv(_capi.LIBRARY_ENV, str(library))
    assert _capi.find_library() == library
    monkeypatch.setenv(_capi.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(ringattn.RingattnError, match=r"RINGATTN_LIBRARY=.*missing\.so is not a file"):
        _capi.find_library()


def test_library_beside_the_package_comes_before_a_build_tree(tmp_path, monkeypatch, no_env):
    package = tmp_path / "site-packages" / "ringattn"
    package.mkdir(parents=True)
    monkeypatch.setattr(_capi, "__file__", str(package / "_capi.py"))
    tree = tmp_path / "tree"
    (tree / "build").mkdir(parents=True)
    (tree / "src").mkdir()
    (tree / "build" / _capi.LIBRARY_NAME).write_bytes(b"")
    monkeypatch.chdir(tree / "src")
    if (Path(sys.prefix) / "lib" / _capi.LIBRARY_NAME).is_file():
        pytest.skip("a library installed under sys.prefix would be found first")
    assert _capi.find_library() == tree / "build" / _capi.LIBRARY_NAME  # from the cwd upward
    (package / "lib").mkdir()
    (package / "lib" / _capi.LIBRARY_NAME).write_bytes(b"")
    assert _capi.find_library() == package / "lib" / _capi.LIBRARY_NAME
    (package / _capi.LIBRARY_NAME).write_bytes(b"")
    assert _capi.find_library() == package / _capi.LIBRARY_NAME


def test_not_found_says_where_it_looked(tmp_path, monkeypatch, no_env):
    package = tmp_path / "site-packages" / "ringattn"
    package.mkdir(parents=True)
    monkeypatch.setattr(_capi, "__file__", str(package / "_capi.py"))
    monkeypatch.chdir(tmp_path)
    if (Path(sys.prefix) / "lib" / _capi.LIBRARY_NAME).is_file():
        pytest.skip("a library installed under sys.prefix would be found")
    with pytest.raises(ringattn.RingattnError) as info:
        _capi.find_library()
    message = str(info.value)
    assert message.startswith("libringattn.so not found: RINGATTN_LIBRARY is not set, none at "
                              f"{package / _capi.LIBRARY_NAME}, ")
    assert f"no build/libringattn.so in {package} and {tmp_path} or a folder above" in message


def test_a_file_that_is_not_a_library_is_named(tmp_path):
    bad = tmp_path / "libringattn.so"
    bad.write_text("not an ELF file")
    with pytest.raises(ringattn.RingattnError, match=f"cannot load {re.escape(str(bad))}"):
        _capi.Library(bad)


def test_status_and_message_of_a_failed_call():
    lib = ringattn.library()
    params = _capi.ForwardParams()
    params.struct_size = 8  # shorter than any version of the struct
    with pytest.raises(ringattn.RingattnError) as info:
        lib.forward(params, None)
    assert isinstance(info.value, RuntimeError) and info.value.status == 1
    older = _capi.ForwardParams.window_left.offset  # the struct of 0.1 to 0.3 ended there
    assert str(info.value) == ("ringattn_attention_forward: params->struct_size is 8; expected "
                               f"sizeof = {ctypes.sizeof(_capi.ForwardParams)} (set it to "
                               "sizeof(the struct)), or the size of an older version: "
                               f"{older} (0.1 to 0.3) (ringattn status 1: invalid argument)")


def c_struct_fields(name):
    """The field names of `typedef struct ... { ... } name;` in ringattn.h, in order."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct \w+ \{([^}]*)\}\s*" + name + ";", text).group(1)
    fields = []
    for declaration in body.split(";"):
        declaration = declaration.strip()
        if not declaration:
            continue
        names = re.sub(r"^const\s+", "", declaration).split(None, 1)[1]  # after the type
        for field in names.split(","):
            fields.append(re.sub(r"[\s*]|\[.*\]", "", field))
    return fields


STRUCTS = [(_capi.Tensor, "ringattn_tensor_t"),
           (_capi.ForwardParams, "ringattn_forward_params_t"),
           (_capi.BackwardParams, "ringattn_backward_params_t"),
           (_capi.RingForwardParams, "ringattn_ring_forward_params_t"),
           (_capi.RingBackwardParams, "ringattn_ring_backward_params_t"),
           (_capi.LayoutParams, "ringattn_layout_params_t")]


@pytest.mark.skipif(not HEADER.is_file(), reason="not in the source tree")
@pytest.mark.parametrize("struct,name", STRUCTS, ids=[name for _, name in STRUCTS])
def test_structs_match_the_header(struct, name):
    assert [f[0] for f in struct._fields_] == c_struct_fields(name)


@pytest.mark.skipif(shutil.which("cc") is None or not HEADER.is_file(),
                    reason="needs a C compiler and the source tree")
def test_struct_layouts_match_the_compiler(tmp_path):
    """sizeof and offsetof of every field, from the C compiler on ringattn.h, against ctypes."""
    # ringattn/config.h is generated into the build's include/: the one beside the library in
    # use (any build folder), else build/.
    candidates = [Path(_capi.find_library()).parent / "include", REPO / "build" / "include"]
    found = [c for c in candidates if (c / "ringattn" / "config.h").is_file()]
    build_include = found[0] if found else candidates[-1]
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "ringattn/ringattn.h"',
             "int main(void) {"]
    for struct, name in STRUCTS:
        lines.append(f'printf("{name} size %zu\\n", sizeof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines.append("return 0; }")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    program = tmp_path / "layout"
    includes = [f"-I{REPO / 'include'}"] + ([f"-I{build_include}"] if build_include.is_dir() else [])
    subprocess.run(["cc", *includes, "-o", str(program), str(source)], check=True)
    c_layout = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    ours = []
    for struct, name in STRUCTS:
        ours.append(f"{name} size {ctypes.sizeof(struct)}")
        ours += [f"{name} {field} {getattr(struct, field).offset}" for field, _ in struct._fields_]
    assert c_layout.split("\n")[:-1] == ours


PACKED = [(_capi.FORWARD, _capi.ForwardParams), (_capi.BACKWARD, _capi.BackwardParams),
          (_capi.RING_FORWARD, _capi.RingForwardParams),
          (_capi.RING_BACKWARD, _capi.RingBackwardParams)]


@pytest.mark.parametrize("packed,struct", PACKED, ids=[s.__name__ for _, s in PACKED])
def test_packed_parameters_are_the_ctypes_struct_bytes(packed, struct):
    """Every field after struct_size given a value of its own (tensors: their 12 fields), the
    packed bytes are the ctypes struct's, set field by field, byte for byte."""
    counter = iter(range(1, 10_000))
    values, expected = [], struct()
    for name, ctype in struct._fields_[1:]:
        if ctype is _capi.Tensor:
            fields = [next(counter) * 7 for _ in range(12)]
            values += fields
            t = getattr(expected, name)
            t.data, t.dtype, t.memory, t.rank = fields[:4]
            t.shape[:], t.strides[:] = fields[4:8], fields[8:]
        else:
            value = next(counter) + (0.5 if ctype is ctypes.c_double else 0)
            values.append(value)
            setattr(expected, name, value)
    assert packed.pack(*values) == bytes(expected)
    assert expected.struct_size == packed.size == ctypes.sizeof(struct)


def test_a_cached_pack_is_the_pack_with_its_own_pointers():
    """pack_cached: a key's first call packs values(); a later call of that key gives pack's bytes
    with the new pointers written into the tensor fields; another key packs its own values."""
    packed = _capi.Packed(_capi.ForwardParams)
    tensors = [torch.empty(2, 9, 4, 8), torch.empty(2, 11, 2, 8), torch.empty(2, 11, 2, 8),
               torch.empty(2, 9, 4, 8), torch.empty(2, 4, 9)]

    def values(pointers, scale):
        fields = []
        for t, pointer in zip(tensors, pointers):
            fields += [pointer, *_capi.tensor_values(t)[1:]]
        return (*fields, scale, 1, 0, 3, 5, *_capi.mask_values(7, 0, None))

    first, second = (11, 22, 33, 44, 55), (101, 202, 303, 404, 505)
    assert packed.pack_cached("a", first, lambda: values(first, 0.5)) == packed.pack(
        *values(first, 0.5))
    assert packed.pack_cached("a", second, lambda: pytest.fail("a key packs once")) == packed.pack(
        *values(second, 0.5))
    assert packed.pack_cached("b", second, lambda: values(second, 0.25)) == packed.pack(
        *values(second, 0.25))


def test_a_packed_descriptor_is_describe():
    t = torch.empty(3, 5, 2, 8)[:, 1:4].transpose(1, 2)
    assert _capi.tensor_bytes(t) == bytes(_capi.describe(t))
    assert _capi.describe(t).strides[:] == list(t.stride()) and _capi.describe(t).rank == 4


def test_wheel_builds_offline_with_the_installed_setuptools(tmp_path):
    """`pip wheel --no-build-isolation --no-index` of python/: no download, a pure-Python wheel
    with the package and its version. Built from a copy: setuptools writes build/ and
    egg-info/ beside the sources."""
    source = tmp_path / "python"
    shutil.copytree(PYTHON_DIR, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache", "tests"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-index", "--no-deps",
         "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list(tmp_path.glob("ringattn-*.whl"))
    assert [w.name for w in wheels] == [f"ringattn-{ringattn.__version__}-py3-none-any.whl"]
    names = zipfile.ZipFile(wheels[0]).namelist()
    for module in ("__init__.py", "_capi.py", "_ops.py", "_version.py"):
        assert f"ringattn/{module}" in names
    assert not any(n.startswith("tests/") for n in names)


def test_a_library_copied_into_the_package_is_installed_with_it(tmp_path):
    source = tmp_path / "python"
    shutil.copytree(PYTHON_DIR, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache", "tests"))
    shutil.copy(ringattn.library().path, source / "ringattn" / _capi.LIBRARY_NAME)
    target = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps",
         "--target", str(target), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = target / "ringattn" / _capi.LIBRARY_NAME
    assert installed.is_file()
    env = dict(os.environ, PYTHONPATH=str(target))
    env.pop(_capi.LIBRARY_ENV, None)
    found = subprocess.run([sys.executable, "-W", "ignore", "-c",
                            "import ringattn; print(ringattn.library().path)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(installed)


def test_bench_helper_is_the_package_underneath():
    """bench/ringattn_ctypes.py (the bench scripts' raw calls) uses the package's structs and
    library check, and its results are the op's, bitwise."""
    import importlib.util
    path = REPO / "bench" / "ringattn_ctypes.py"
    if not path.is_file():
        pytest.skip("not in the source tree")
    spec = importlib.util.spec_from_file_location("ringattn_ctypes", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    assert shim.ForwardParams is _capi.ForwardParams and shim.BackwardParams is _capi.BackwardParams
    ra = shim.Ringattn(ringattn.library().path)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 9, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2, 4))
    o, lse = ra.forward(q, k, v, causal=True, q_start=2)
    dq, dk, dv = ra.backward(q, k, v, o, lse, do, causal=True, q_start=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o2, lse2 = ringattn.attention(*leaves, causal=True, q_start=2, return_lse=True)
    o2.backward(do)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for raw, leaf in zip((dq, dk, dv), leaves):
        assert torch.equal(raw, leaf.grad)
    o_plain = o
    # The same with a window and per-batch documents.
    mask = dict(window=(4, None), document_starts=torch.tensor([[0, 5], [3, 3]]))
    o, lse = ra.forward(q, k, v, causal=True, q_start=2, **mask)
    dq, dk, dv = ra.backward(q, k, v, o, lse, do, causal=True, q_start=2, **mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o2, lse2 = ringattn.attention(*leaves, causal=True, q_start=2, return_lse=True, **mask)
    o2.backward(do)
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and not torch.equal(o, o_plain)
    for raw, leaf in zip((dq, dk, dv), leaves):
        assert torch.equal(raw, leaf.grad)
    # Positional construction, as the bench scripts build their parameter structs.
    params = shim.ForwardParams(ctypes.sizeof(shim.ForwardParams), shim.describe(q),
                                shim.describe(k), shim.describe(v), shim.describe(o),
                                shim.describe(lse), 0.5, 1, 0, 0, 0)
    assert params.struct_size == ctypes.sizeof(_capi.ForwardParams) and params.scale == 0.5
