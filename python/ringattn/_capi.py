"""ringattn's C API (include/ringattn/ringattn.h) through ctypes: the structs, written once here,
the library's discovery and version check, and torch tensors as descriptors.

The structs follow ringattn.h field for field. Parameter structs start with struct_size, which is
set to this module's sizeof: a library of this major.minor (the version check) or a later one
reads exactly the fields of that version, and fields a later library appends keep their defaults.
"""
import ctypes
import os
import struct
import sys
from pathlib import Path

import torch

from ringattn._version import __version__

# ringattn_status_t
SUCCESS = 0
STATUS_NAMES = {0: "success", 1: "invalid argument", 2: "unsupported", 3: "library call failed",
                4: "I/O", 5: "internal"}

# ringattn_dtype_t, ringattn_memory_t and ringattn_layout_t
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
HOST, DEVICE = 0, 1
LAYOUT_CODES = {"contiguous": 0, "zigzag": 1, "balanced": 2}
# RINGATTN_NCCL_UNIQUE_ID_BYTES: the id ringattn_nccl_unique_id makes and ringattn_ring_create_nccl takes.
NCCL_UNIQUE_ID_BYTES = 128

LIBRARY_ENV = "RINGATTN_LIBRARY"
LIBRARY_NAME = "libringattn.so"


class RingattnError(RuntimeError):
    """A ringattn call failed: the library's status and its message (ringattn_last_error()), or
    the library could not be found, loaded or matched to this package."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class Tensor(ctypes.Structure):
    """ringattn_tensor_t: extents and strides in elements."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("memory", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4)]


# The window and documents appended to every parameter struct in 0.4 (document_starts is a
# const int64_t*, set from a tensor's data_ptr()).
MASK_FIELDS = [("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
               ("document_starts", ctypes.c_void_p), ("num_documents", ctypes.c_int64),
               ("document_batch_stride", ctypes.c_int64)]


def mask_values(window_left, window_right, document_starts):
    """The MASK_FIELDS' values, in order, of a window and of an int64 tensor of document starts
    ([count], or [batch, count] with unit stride along count; None: one document)."""
    if document_starts is None or document_starts.shape[-1] == 0:
        return window_left, window_right, 0, 0, 0
    return (window_left, window_right, document_starts.data_ptr(), document_starts.shape[-1],
            document_starts.stride(0) if document_starts.dim() == 2 else 0)


def mask_fields(window_left, window_right, document_starts):
    """The MASK_FIELDS by name (mask_values), for a ctypes parameter struct."""
    return dict(zip((name for name, _ in MASK_FIELDS),
                    mask_values(window_left, window_right, document_starts)))


class ForwardParams(ctypes.Structure):
    """ringattn_forward_params_t, with the window and documents appended in 0.4."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("o", Tensor), ("lse", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32), ("combine", ctypes.c_int32),
                ("q_start", ctypes.c_int64), ("k_start", ctypes.c_int64)] + MASK_FIELDS

    def __init__(self, *args, **fields):
        if not args:  # fields by name: struct_size is this struct's sizeof unless given
            fields.setdefault("struct_size", ctypes.sizeof(type(self)))
        super().__init__(*args, **fields)


class BackwardParams(ctypes.Structure):
    """ringattn_backward_params_t, with the fields appended in 0.2 (overwrite_key_gradients), 0.3
    (key_rotation_cos, key_rotation_sin; rank 0: no rotation) and 0.4 (window and documents)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("dout", Tensor), ("lse", Tensor), ("delta", Tensor), ("dq", Tensor),
                ("dk", Tensor), ("dv", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32), ("deterministic", ctypes.c_int32),
                ("q_start", ctypes.c_int64), ("k_start", ctypes.c_int64),
                ("overwrite_key_gradients", ctypes.c_int32),
                ("key_rotation_cos", Tensor), ("key_rotation_sin", Tensor)] + MASK_FIELDS

    def __init__(self, *args, **fields):
        if not args:  # fields by name: struct_size is this struct's sizeof unless given
            fields.setdefault("struct_size", ctypes.sizeof(type(self)))
        super().__init__(*args, **fields)


class RingForwardParams(ctypes.Structure):
    """ringattn_ring_forward_params_t, with the window and documents appended in 0.4."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("o", Tensor), ("lse", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32)] + MASK_FIELDS

    def __init__(self, *args, **fields):
        if not args:  # fields by name: struct_size is this struct's sizeof unless given
            fields.setdefault("struct_size", ctypes.sizeof(type(self)))
        super().__init__(*args, **fields)


class RingBackwardParams(ctypes.Structure):
    """ringattn_ring_backward_params_t, with the window and documents appended in 0.4."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("o", Tensor), ("lse", Tensor), ("dout", Tensor), ("dq", Tensor),
                ("dk", Tensor), ("dv", Tensor), ("scale", ctypes.c_double),
                ("causal", ctypes.c_int32), ("deterministic", ctypes.c_int32)] + MASK_FIELDS

    def __init__(self, *args, **fields):
        if not args:  # fields by name: struct_size is this struct's sizeof unless given
            fields.setdefault("struct_size", ctypes.sizeof(type(self)))
        super().__init__(*args, **fields)


class LayoutParams(ctypes.Structure):
    """ringattn_layout_params_t (0.6): a rank's chunks under a layout and the ring calls' mask."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("layout", ctypes.c_int32),
                ("size", ctypes.c_int32), ("rank", ctypes.c_int32), ("causal", ctypes.c_int32),
                ("seq_len", ctypes.c_int64), ("batch", ctypes.c_int64)] + MASK_FIELDS

    def __init__(self, *args, **fields):
        if not args:  # fields by name: struct_size is this struct's sizeof unless given
            fields.setdefault("struct_size", ctypes.sizeof(type(self)))
        super().__init__(*args, **fields)


# ringattn_tensor_t's bytes as struct packs them (native alignment, as ctypes lays it out):
# one pack and one copy a descriptor, the cheapest way to one from Python.
_TENSOR_FORMAT = "Piii4q4q"
_TENSOR_BYTES = struct.Struct("@" + _TENSOR_FORMAT)
assert (_TENSOR_BYTES.size == ctypes.sizeof(Tensor) and Tensor.shape.offset == 24
        and Tensor.strides.offset == 56), "ringattn_tensor_t's layout is not the one packed"
_NO_EXTENTS = ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def tensor_values(t):
    """The fields of a torch tensor's descriptor (rank <= 4, a view: no copy), in order."""
    pad = _NO_EXTENTS[4 - t.dim()]
    return (t.data_ptr(), DTYPE_CODES[t.dtype], DEVICE if t.is_cuda else HOST, t.dim(), *t.shape,
            *pad, *t.stride(), *pad)


# tensor_values of the rank-0 descriptor that stands for no tensor.
NO_TENSOR = (0,) * 12


def tensor_bytes(t, values=None):
    """describe(t)'s bytes, which every Library method takes in place of a descriptor; from its
    tensor_values where the caller has them already."""
    return _TENSOR_BYTES.pack(*(tensor_values(t) if values is None else values))


def describe(t):
    """The descriptor of a torch tensor of rank <= 4 (a view: no copy)."""
    return Tensor.from_buffer_copy(tensor_bytes(t))


# One data pointer, and how many call shapes a Packed keeps templates for (pack_cached).
_POINTER = struct.Struct("@P")
_TEMPLATES_KEPT = 64

_FORMAT_CODES = {ctypes.c_size_t: "N", ctypes.c_int32: "i", ctypes.c_int64: "q",
                 ctypes.c_double: "d", ctypes.c_void_p: "P", Tensor: _TENSOR_FORMAT}


class Packed:
    """A parameter struct's bytes from one struct.pack of its fields in order (a tensor as its
    tensor_values), struct_size set to the struct's sizeof: several times cheaper than building
    the ctypes struct, and what a hot call passes. Every Library method takes these bytes in
    place of the struct (the C API only reads it). The layout is checked against ctypes' own
    field by field."""

    def __init__(self, structure):
        fmt = "@"
        for name, ctype in structure._fields_:
            code = _FORMAT_CODES[ctype]
            offset = struct.calcsize(fmt + code) - struct.calcsize("@" + code)
            assert offset == getattr(structure, name).offset, (
                f"{structure.__name__}.{name}: struct puts it at {offset}")
            fmt += code
        self.size = ctypes.sizeof(structure)
        assert struct.calcsize(fmt) == self.size, f"{structure.__name__}'s size differs"
        self._pack = struct.Struct(fmt).pack
        # Where each tensor field's data pointer sits (a descriptor's first field).
        self._pointer_offsets = tuple(getattr(structure, name).offset
                                      for name, ctype in structure._fields_ if ctype is Tensor)
        self._templates = {}

    def pack(self, *values):
        """The struct's bytes: values of every field after struct_size, in order."""
        return self._pack(self.size, *values)

    def pack_cached(self, key, pointers, values):
        """pack(*values()) for a call in which key determines every field but the tensors' data
        pointers: the bytes packed at key's first call, with pointers (one a tensor field, in
        order, 0 for no tensor) written over them. values is called at a key's first call only.
        About half the host time of pack where the tensors are described alike call after call;
        the caller owns key's completeness (shapes, strides and dtypes of every tensor field, or
        what they follow from, and every other field's value)."""
        template = self._templates.get(key)
        if template is None:
            assert len(pointers) == len(self._pointer_offsets), (
                f"{len(pointers)} pointers for {len(self._pointer_offsets)} tensor fields")
            if len(self._templates) >= _TEMPLATES_KEPT:
                self._templates.clear()
            params = self._templates[key] = self.pack(*values())
            return params
        params = bytearray(template)
        write = _POINTER.pack_into
        for offset, pointer in zip(self._pointer_offsets, pointers):
            write(params, offset, pointer)
        return bytes(params)


FORWARD = Packed(ForwardParams)
BACKWARD = Packed(BackwardParams)
RING_FORWARD = Packed(RingForwardParams)
RING_BACKWARD = Packed(RingBackwardParams)


def _ref(params):
    """The pointer argument of a parameter struct or descriptor: packed bytes as they are (the C
    API only reads them), a ctypes struct by reference."""
    return params if type(params) is bytes else ctypes.byref(params)


def _version_tuple(text):
    major, minor, *_ = text.split(".")
    return int(major), int(minor)


def _search_roots():
    """The folders whose build/ (and whose parents' build/) may hold a source tree's library."""
    return [Path(__file__).resolve().parent, Path.cwd().resolve()]


def _candidates():
    """Where the library is looked for when RINGATTN_LIBRARY is not set, in order."""
    package_dir = Path(__file__).resolve().parent
    found = [package_dir / LIBRARY_NAME, package_dir / "lib" / LIBRARY_NAME,
             Path(sys.prefix) / "lib" / LIBRARY_NAME]
    for start in _search_roots():
        for folder in (start, *start.parents):
            found.append(folder / "build" / LIBRARY_NAME)
    return found


def find_library():
    """The path of the shared library this package uses: RINGATTN_LIBRARY if set, else the
    library installed beside the package (ringattn/libringattn.so, ringattn/lib/, then
    <sys.prefix>/lib/), else build/libringattn.so of a source tree above the package or the
    current directory."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise RingattnError(f"{LIBRARY_ENV}={env} is not a file; set it to the path of "
                                f"{LIBRARY_NAME}, or unset it to search the usual places")
        return path
    candidates = _candidates()
    for path in candidates:
        if path.is_file():
            return path
    beside = ", ".join(str(p) for p in candidates[:3])
    roots = " and ".join(str(p) for p in dict.fromkeys(_search_roots()))
    raise RingattnError(f"{LIBRARY_NAME} not found: {LIBRARY_ENV} is not set, none at {beside}, "
                        f"and no build/{LIBRARY_NAME} in {roots} or a folder above. Build it "
                        f"(cmake --build build) or set {LIBRARY_ENV} to its path")


class Library:
    """The loaded library, its version checked against the package's."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise RingattnError(f"cannot load {self.path}: {e}") from e
        lib = self.lib
        # The version first: a library of another minor version may lack entry points bound below.
        lib.ringattn_version.restype = ctypes.c_int
        lib.ringattn_version.argtypes = []
        # char* results: ctypes' default restype (C int) would cut a 64-bit pointer.
        for name in ("ringattn_version_string", "ringattn_last_error"):
            getattr(lib, name).restype = ctypes.c_char_p
            getattr(lib, name).argtypes = []
        code = lib.ringattn_version()
        self.version = lib.ringattn_version_string().decode()
        self.version_code = code
        library = (code // 10000, code // 100 % 100)
        package = _version_tuple(__version__)
        if library != package:
            raise RingattnError(
                f"{self.path} is ringattn {self.version} (version code {code}) but the Python "
                f"package ringattn is {__version__}; they must share major.minor "
                f"({package[0]}.{package[1]}.x). Build the matching library or set "
                f"{LIBRARY_ENV} to one")
        lib.ringattn_status_string.restype = ctypes.c_char_p
        lib.ringattn_status_string.argtypes = [ctypes.c_int]
        lib.ringattn_cuda_device_count.restype = ctypes.c_int
        lib.ringattn_cuda_device_count.argtypes = []
        for name in ("ringattn_attention_forward", "ringattn_attention_backward"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ringattn_attention_backward_prepare.restype = ctypes.c_int
        lib.ringattn_attention_backward_prepare.argtypes = [ctypes.c_void_p] * 4
        lib.ringattn_attention_backward_prepare_zero_dq.restype = ctypes.c_int
        lib.ringattn_attention_backward_prepare_zero_dq.argtypes = [ctypes.c_void_p] * 5
        # ringattn_ring_t is a pointer: passed and returned as c_void_p.
        lib.ringattn_ring_create.restype = ctypes.c_int
        lib.ringattn_ring_create.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                             ctypes.POINTER(ctypes.c_void_p)]
        lib.ringattn_nccl_unique_id.restype = ctypes.c_int
        lib.ringattn_nccl_unique_id.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.ringattn_ring_create_nccl.restype = ctypes.c_int
        lib.ringattn_ring_create_nccl.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32,
                                                  ctypes.c_int32, ctypes.c_int32,
                                                  ctypes.POINTER(ctypes.c_void_p)]
        lib.ringattn_ring_destroy.restype = ctypes.c_int
        lib.ringattn_ring_destroy.argtypes = [ctypes.c_void_p]
        for name in ("ringattn_ring_forward", "ringattn_ring_backward"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_void_p] * 3
        lib.ringattn_layout_chunks.restype = ctypes.c_int
        lib.ringattn_layout_chunks.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                                               ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                               ctypes.POINTER(ctypes.c_int64)]

    def check(self, status):
        """Raises RingattnError with the library's message when status is not success."""
        if status != SUCCESS:
            message = self.lib.ringattn_last_error().decode(errors="replace")
            name = self.lib.ringattn_status_string(status).decode(errors="replace")
            raise RingattnError(f"{message} (ringattn status {status}: {name})", status=status)

    def forward(self, params, stream):
        self.check(self.lib.ringattn_attention_forward(_ref(params), stream))

    def backward_prepare(self, o, dout, delta, stream, dq=None):
        """delta = rowsum(dout * o); and dq = 0 in the same pass where dq is given."""
        if dq is None:
            self.check(self.lib.ringattn_attention_backward_prepare(
                _ref(o), _ref(dout), _ref(delta), stream))
        else:
            self.check(self.lib.ringattn_attention_backward_prepare_zero_dq(
                _ref(o), _ref(dout), _ref(delta), _ref(dq), stream))

    def backward(self, params, stream):
        self.check(self.lib.ringattn_attention_backward(_ref(params), stream))

    def ring_create(self, mpi_comm_address, memory, layout):
        """A new ring handle over the MPI_Comm at mpi_comm_address (collective)."""
        handle = ctypes.c_void_p()
        self.check(self.lib.ringattn_ring_create(mpi_comm_address, memory, layout,
                                                 ctypes.byref(handle)))
        return handle

    def nccl_unique_id(self):
        """A new NCCL unique id, NCCL_UNIQUE_ID_BYTES bytes, for ring_create_nccl on every rank."""
        buffer = ctypes.create_string_buffer(NCCL_UNIQUE_ID_BYTES)
        self.check(self.lib.ringattn_nccl_unique_id(buffer, NCCL_UNIQUE_ID_BYTES))
        return buffer.raw

    def ring_create_nccl(self, unique_id, rank, size, layout):
        """A new ring handle over NCCL alone, from the id every rank was given (collective)."""
        handle = ctypes.c_void_p()
        self.check(self.lib.ringattn_ring_create_nccl(unique_id, len(unique_id), rank, size, layout,
                                                      ctypes.byref(handle)))
        return handle

    def ring_destroy(self, handle):
        self.check(self.lib.ringattn_ring_destroy(handle))

    def ring_forward(self, handle, params, stream):
        self.check(self.lib.ringattn_ring_forward(handle, _ref(params), stream))

    def ring_backward(self, handle, params, stream):
        self.check(self.lib.ringattn_ring_backward(handle, _ref(params), stream))

    def layout_chunks(self, params):
        """[(global_start, length)] of a rank's chunks in local order (ringattn_layout_chunks);
        RingattnError with the library's message for arguments it refuses."""
        capacity = 8
        while True:
            starts, lengths = (ctypes.c_int64 * capacity)(), (ctypes.c_int64 * capacity)()
            count = ctypes.c_int64(0)
            status = self.lib.ringattn_layout_chunks(ctypes.byref(params), starts, lengths,
                                                     capacity, ctypes.byref(count))
            if status != SUCCESS and count.value > capacity:  # room for the count it named
                capacity = count.value
                continue
            self.check(status)
            return [(starts[i], lengths[i]) for i in range(count.value)]

    def cuda_device_count(self):
        return self.lib.ringattn_cuda_device_count()


_library = None


def library():
    """The library, found, loaded and checked at the first call (not at import)."""
    global _library
    if _library is None:
        _library = Library(find_library())
    return _library
