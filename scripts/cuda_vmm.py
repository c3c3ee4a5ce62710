"""The CUDA driver's virtual-memory API through ctypes, shared by the scripts that measure it
(vmm_cost.py, vmm_sync.py, vmm_async.py): libcuda.so.1, its structures, the argument types of
the calls they make, and the allocation properties and access descriptor of one device's
pinned memory. No dependency but the driver."""
import ctypes
from ctypes import (POINTER, Structure, byref, c_int, c_size_t, c_ubyte, c_uint, c_ulonglong,
                    c_ushort, c_void_p)

MIB = 1 << 20
PAGE = 2 * MIB

cu = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


class Loc(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class Flags(Structure):
    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte),
                ("usage", c_ushort), ("reserved", c_ubyte * 4)]


class Prop(Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Loc),
                ("win32HandleMetaData", c_void_p), ("allocFlags", Flags)]


class Access(Structure):
    _fields_ = [("location", Loc), ("flags", c_int)]


cu.cuMemAddressReserve.argtypes = [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong]
cu.cuMemCreate.argtypes = [POINTER(c_ulonglong), c_size_t, POINTER(Prop), c_ulonglong]
cu.cuMemMap.argtypes = [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong]
cu.cuMemSetAccess.argtypes = [c_ulonglong, c_size_t, POINTER(Access), c_size_t]
cu.cuMemUnmap.argtypes = [c_ulonglong, c_size_t]
cu.cuMemRelease.argtypes = [c_ulonglong]
cu.cuMemAddressFree.argtypes = [c_ulonglong, c_size_t]
cu.cuMemAlloc_v2.argtypes = [POINTER(c_ulonglong), c_size_t]
cu.cuMemFree_v2.argtypes = [c_ulonglong]
cu.cuMemHostAlloc.argtypes = [POINTER(c_void_p), c_size_t, c_uint]
cu.cuMemHostGetDevicePointer_v2.argtypes = [POINTER(c_ulonglong), c_void_p, c_uint]
cu.cuStreamWaitValue32_v2.argtypes = [c_void_p, c_ulonglong, c_uint, c_uint]
cu.cuMemsetD32Async.argtypes = [c_ulonglong, c_uint, c_size_t, c_void_p]
cu.cuMemcpyHtoDAsync_v2.argtypes = [c_ulonglong, c_void_p, c_size_t, c_void_p]


def pinned_on(device):
    """(allocation properties, access descriptor) for pinned memory of `device`, read-write."""
    prop = Prop()
    prop.type = 1  # pinned
    prop.location.type = 1  # device
    prop.location.id = device
    acc = Access()
    acc.location.type = 1
    acc.location.id = device
    acc.flags = 3  # read-write
    return prop, acc


def start_on_torch_device(torch):
    """Makes PyTorch's primary context current on this thread (through a first tensor),
    initialises the driver API, and returns pinned_on(the current device)."""
    torch.zeros(1, device="cuda")
    ck(cu.cuInit(0), "cuInit")
    return pinned_on(torch.cuda.current_device())


def reserve(size):
    """A reservation of `size` bytes of virtual address space; returns its base address."""
    va = c_ulonglong()
    ck(cu.cuMemAddressReserve(byref(va), size, 0, 0, 0), "reserve")
    return va.value


def create_page(prop):
    """One physical page (PAGE bytes) with the allocation properties `prop`; returns its handle."""
    h = c_ulonglong()
    ck(cu.cuMemCreate(byref(h), PAGE, byref(prop), 0), "create")
    return h.value
