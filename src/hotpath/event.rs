//! The compact event that hooks publish and the collector consumes.

/// What a block is: host heap memory, or one of the CUDA kinds. Reported as `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Host,
    Device,
    Pinned,
    Managed,
    /// Virtual address space reserved with `cuMemAddressReserve` (no memory behind it).
    Reservation,
    /// Physical memory mapped into a reservation with `cuMemMap`.
    Mapping,
    /// Python objects in pymalloc's arenas, sampled by bytes: each sampled object
    /// stands for the bytes around it (`interpose::pyalloc`).
    Python,
    /// Anonymous memory the program mapped itself (`mmap` outside malloc).
    Mmap,
}

impl Kind {
    pub const ALL: [Kind; 8] = [Kind::Host, Kind::Device, Kind::Pinned, Kind::Managed, Kind::Reservation, Kind::Mapping, Kind::Python, Kind::Mmap];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Host => "host",
            Kind::Device => "device",
            Kind::Pinned => "pinned",
            Kind::Managed => "managed",
            Kind::Reservation => "reservation",
            Kind::Mapping => "mapping",
            Kind::Python => "python",
            Kind::Mmap => "mmap",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Which key space an address lives in. The same number can name two live things at
/// once in different spaces: a `malloc` block and its `cudaHostRegister` registration,
/// or a VMM handle (an opaque number) and a heap address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Space {
    /// The malloc family.
    Heap = 0,
    /// Device, managed and page-locked allocations (each a fresh virtual range).
    Cuda = 1,
    /// Host ranges page-locked with `cudaHostRegister` / `cuMemHostRegister`.
    Registered = 2,
    /// `cuMemCreate` handles.
    VmmHandle = 3,
    /// `cuMemAddressReserve` ranges.
    VmmReservation = 4,
    /// `cuMemMap` mappings, by virtual address.
    VmmMapping = 5,
    /// Sampled Python objects (addresses in pymalloc's arenas).
    Python = 6,
    /// The program's own anonymous mappings.
    Mmap = 7,
}

/// Implicitly released by a context destroy or device reset (VMM and pool memory are not).
impl Space {
    pub fn bound_to_context(self) -> bool {
        matches!(self, Space::Cuda | Space::Registered)
    }
}

macro_rules! apis {
    ($($variant:ident = $n:literal => $name:literal, $kind:ident, $space:ident;)*) => {
        /// Which allocation entry point produced a block. Kept in 7 bits of an event.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Api { $($variant = $n,)* }

        impl Api {
            pub const ALL: &'static [Api] = &[$(Api::$variant,)*];

            pub fn name(self) -> &'static str {
                match self { $(Api::$variant => $name,)* }
            }

            #[inline(always)]
            pub fn kind(self) -> Kind {
                match self { $(Api::$variant => Kind::$kind,)* }
            }

            #[inline(always)]
            pub fn space(self) -> Space {
                match self { $(Api::$variant => Space::$space,)* }
            }

            /// The API of an event's 7 bits (`Malloc` for a value no API has): a
            /// table, not a match (the consumer decodes every event).
            #[inline(always)]
            pub fn from_bits(b: u8) -> Api {
                const TABLE: [Api; 128] = {
                    let mut t = [Api::Malloc; 128];
                    $(t[$n] = Api::$variant;)*
                    t
                };
                TABLE[(b & 0x7f) as usize]
            }
        }
    };
}

apis! {
    Malloc = 0 => "malloc", Host, Heap;
    Calloc = 1 => "calloc", Host, Heap;
    Realloc = 2 => "realloc", Host, Heap;
    Reallocarray = 3 => "reallocarray", Host, Heap;
    PosixMemalign = 4 => "posix_memalign", Host, Heap;
    AlignedAlloc = 5 => "aligned_alloc", Host, Heap;
    Memalign = 6 => "memalign", Host, Heap;
    Valloc = 7 => "valloc", Host, Heap;
    Pvalloc = 8 => "pvalloc", Host, Heap;
    // CUDA runtime API.
    CudaMalloc = 16 => "cudaMalloc", Device, Cuda;
    CudaMallocAsync = 17 => "cudaMallocAsync", Device, Cuda;
    CudaMallocFromPoolAsync = 18 => "cudaMallocFromPoolAsync", Device, Cuda;
    CudaMallocPitch = 19 => "cudaMallocPitch", Device, Cuda;
    CudaMalloc3D = 20 => "cudaMalloc3D", Device, Cuda;
    CudaMallocManaged = 21 => "cudaMallocManaged", Managed, Cuda;
    CudaMallocHost = 22 => "cudaMallocHost", Pinned, Cuda;
    CudaHostAlloc = 23 => "cudaHostAlloc", Pinned, Cuda;
    CudaHostRegister = 24 => "cudaHostRegister", Pinned, Registered;
    // CUDA driver API.
    CuMemAlloc = 32 => "cuMemAlloc", Device, Cuda;
    CuMemAllocPitch = 33 => "cuMemAllocPitch", Device, Cuda;
    CuMemAllocAsync = 34 => "cuMemAllocAsync", Device, Cuda;
    CuMemAllocFromPoolAsync = 35 => "cuMemAllocFromPoolAsync", Device, Cuda;
    CuMemAllocManaged = 36 => "cuMemAllocManaged", Managed, Cuda;
    CuMemAllocHost = 37 => "cuMemAllocHost", Pinned, Cuda;
    CuMemHostAlloc = 38 => "cuMemHostAlloc", Pinned, Cuda;
    CuMemHostRegister = 39 => "cuMemHostRegister", Pinned, Registered;
    CuMemCreate = 40 => "cuMemCreate", Device, VmmHandle;
    CuMemAddressReserve = 41 => "cuMemAddressReserve", Reservation, VmmReservation;
    CuMemMap = 42 => "cuMemMap", Mapping, VmmMapping;
    // Python objects, sampled (`interpose::pyalloc`).
    PyObject = 48 => "PyObject_Malloc", Python, Python;
    // Direct mappings (`interpose::mmap`).
    Mmap = 56 => "mmap", Mmap, Mmap;
    Mremap = 57 => "mremap", Mmap, Mmap;
}

impl Api {
    /// A realloc-family result completes the release published before the call.
    pub fn is_realloc(self) -> bool {
        matches!(self, Api::Realloc | Api::Reallocarray)
    }

    /// An allocation its own thread may free before the collector takes it, turning
    /// the two events into one (`EventKind::Transient`): a heap block from any entry
    /// point but the realloc family (whose event also completes a release), or a
    /// sampled Python object.
    #[inline(always)]
    pub fn cancellable(self) -> bool {
        (self.space() == Space::Heap && !self.is_realloc()) || self == Api::PyObject
    }

    /// The API a free in `space` is published under (a free only needs its space).
    pub fn releasing(space: Space) -> Api {
        match space {
            Space::Heap => Api::Malloc,
            Space::Cuda => Api::CuMemAlloc,
            Space::Registered => Api::CuMemHostRegister,
            Space::VmmHandle => Api::CuMemCreate,
            Space::VmmReservation => Api::CuMemAddressReserve,
            Space::VmmMapping => Api::CuMemMap,
            Space::Python => Api::PyObject,
            Space::Mmap => Api::Mmap,
        }
    }
}

/// An event's size word: the byte count, with the CUDA device ordinal + 1 in the top
/// 8 bits (0: no device). No allocation reaches 2^56 bytes.
pub fn pack_size(bytes: u64, device: Option<u8>) -> u64 {
    (bytes & SIZE_MASK) | (device_code(device).min(255) << 56)
}

/// A CUDA device ordinal as a number that is 0 for none known (ordinal + 1 otherwise,
/// at most 256), and back (`device_of_code`).
pub fn device_code(device: Option<u8>) -> u64 {
    device.map_or(0, |d| d as u64 + 1)
}

pub fn device_of_code(code: u64) -> Option<u8> {
    match code {
        0 => None,
        d => Some((d - 1) as u8),
    }
}

const SIZE_MASK: u64 = (1 << 56) - 1;

/// The `stack` of a `Free` published after tracking stopped, while the final report
/// still wants frees (`Lifecycle::frees_still_wanted`): the block may be one allocated
/// unseen since, so an address not in the live set is no diagnostic.
pub const LATE_FREE: u32 = 1;

/// The `stack` of a `Free` published from a thread that records nothing of its own (the
/// library's threads, `thread::untracked`): most such frees are the library's own blocks
/// (no diagnostic); one that takes a block out of the live set is the C library freeing
/// what a program thread allocated (`Totals::frees_on_library_threads`).
pub const INTERNAL_FREE: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum EventKind {
    /// A block was handed out (published after the real allocator returned).
    Alloc = 1,
    /// A block is about to be freed (published before the real free runs).
    Free = 2,
    /// A realloc (or a CUDA free, which can fail) is about to run on `addr`: the block
    /// leaves the live set for now.
    ReallocRelease = 3,
    /// The call failed: the released block is live again.
    ReallocRestore = 4,
    /// The call freed the block without a new one (`realloc(p, 0)`, a CUDA free).
    ReallocFreed = 5,
    /// A checkpoint region starts (`leaktrace_mark`): no address.
    Mark = 6,
    /// The block at `addr` is never a leak (`__lsan_ignore_object`, `__lsan_disable`).
    Ignore = 7,
    /// An allocation that the same thread freed while its event still waited in the
    /// thread's ring (`hotpath::channel::cancel_alloc`): the allocation and the free in
    /// one event, which counts in the totals and its group's and never enters the live
    /// set. Never published as such: an `Alloc` slot whose meta carries `TRANSIENT_BIT`.
    Transient = 8,
}

/// The bit of an `Alloc` slot's meta word that makes it a `Transient` event. One of the
/// thread-id bits, which producers leave zero (the consumer takes the thread id from
/// the ring).
pub const TRANSIENT_BIT: u64 = 1 << 53;

impl EventKind {
    /// Events about an address that another thread may touch next: they take a ticket
    /// in the address's bucket (see `hotpath::channel`).
    pub fn orders_by_address(self) -> bool {
        matches!(self, EventKind::Alloc | EventKind::Free | EventKind::ReallocRelease | EventKind::Ignore | EventKind::Transient)
    }

    /// Events that take a block out of the live set on an address: counted as releases
    /// in their ticket bucket (`hotpath::channel`).
    #[inline(always)]
    pub fn releases(self) -> bool {
        matches!(self, EventKind::Free | EventKind::ReallocRelease)
    }

    /// The kind of an event's 3 bits (`None`: an empty slot). A table, not a match.
    #[inline(always)]
    pub fn from_bits(b: u8) -> Option<EventKind> {
        const TABLE: [Option<EventKind>; 8] = [
            None,
            Some(EventKind::Alloc),
            Some(EventKind::Free),
            Some(EventKind::ReallocRelease),
            Some(EventKind::ReallocRestore),
            Some(EventKind::ReallocFreed),
            Some(EventKind::Mark),
            Some(EventKind::Ignore),
        ];
        TABLE.get(b as usize).copied().flatten()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub api: Api,
    pub tid: u32,
    pub stack: u32,
    pub addr: u64,
    /// Packed with `pack_size`: read it with `bytes()` and `device()`.
    pub size: u64,
}

/// Bits of the meta word: stack id 32, thread id 22 (the kernel's pid_max is at most
/// 2^22), kind 3, api 7.
const TID_BITS: u32 = 22;

impl Event {
    /// The meta word of a slot. A producer's event has thread id 0; an `Alloc` with one
    /// of 2^21 or more would read back as `Transient`.
    pub fn pack_meta(&self) -> u64 {
        let (kind, transient) = match self.kind {
            EventKind::Transient => (EventKind::Alloc as u64, TRANSIENT_BIT),
            k => (k as u64, 0),
        };
        (self.stack as u64) | (((self.tid & ((1 << TID_BITS) - 1)) as u64) << 32) | transient | ((kind & 0x7) << 54) | ((self.api as u64 & 0x7f) << 57)
    }

    #[inline(always)]
    pub fn unpack(meta: u64, addr: u64, size: u64) -> Option<Event> {
        let mut kind = EventKind::from_bits(((meta >> 54) & 0x7) as u8)?;
        let mut meta = meta;
        if kind == EventKind::Alloc && meta & TRANSIENT_BIT != 0 {
            kind = EventKind::Transient;
            meta &= !TRANSIENT_BIT;
        }
        Some(Event {
            kind,
            api: Api::from_bits(((meta >> 57) & 0x7f) as u8),
            tid: ((meta >> 32) & ((1 << TID_BITS) - 1)) as u32,
            stack: meta as u32,
            addr,
            size,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.size & SIZE_MASK
    }

    /// The CUDA device ordinal the block belongs to, when known.
    pub fn device(&self) -> Option<u8> {
        device_of_code(self.size >> 56)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips() {
        for (i, api) in Api::ALL.iter().enumerate() {
            let e = Event {
                kind: EventKind::ReallocRelease,
                api: *api,
                tid: 4_194_303 - i as u32,
                stack: u32::MAX - i as u32,
                addr: 0x7fff_dead_beef,
                size: pack_size(12345, Some(i as u8)),
            };
            let back = Event::unpack(e.pack_meta(), e.addr, e.size).unwrap();
            assert_eq!(back, e);
            assert_eq!((back.bytes(), back.device()), (12345, Some(i as u8)));
            assert_eq!(Api::from_bits(*api as u8), *api);
        }
        let host = Event { kind: EventKind::Free, api: Api::Malloc, tid: 1, stack: 0, addr: 0, size: pack_size(77, None) };
        let alloc = Event { kind: EventKind::Alloc, api: Api::Calloc, tid: 0, stack: 9, addr: 0x10, size: 32 };
        let cancelled = Event::unpack(alloc.pack_meta() | TRANSIENT_BIT, 0x10, 32).unwrap();
        assert_eq!(cancelled, Event { kind: EventKind::Transient, ..alloc });
        let back = Event::unpack(host.pack_meta(), 0, host.size).unwrap();
        assert_eq!((back.kind, back.bytes(), back.device()), (EventKind::Free, 77, None));
    }

    #[test]
    fn every_cuda_api_has_a_cuda_kind_and_space() {
        for api in Api::ALL {
            let host = api.kind() == Kind::Host;
            assert_eq!(host, api.space() == Space::Heap, "{api:?}");
            assert_eq!(Api::releasing(api.space()).space(), api.space());
        }
    }

    #[test]
    fn unknown_kind_is_rejected() {
        assert_eq!(Event::unpack(0, 1, 2), None);
    }
}
