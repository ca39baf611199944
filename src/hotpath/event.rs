//! The compact event that hooks publish and the collector consumes.

/// Which allocation entry point produced a block. Kept in 4 bits of an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Api {
    Malloc = 0,
    Calloc = 1,
    Realloc = 2,
    Reallocarray = 3,
    PosixMemalign = 4,
    AlignedAlloc = 5,
    Memalign = 6,
    Valloc = 7,
    Pvalloc = 8,
}

impl Api {
    pub const ALL: [Api; 9] = [
        Api::Malloc,
        Api::Calloc,
        Api::Realloc,
        Api::Reallocarray,
        Api::PosixMemalign,
        Api::AlignedAlloc,
        Api::Memalign,
        Api::Valloc,
        Api::Pvalloc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Api::Malloc => "malloc",
            Api::Calloc => "calloc",
            Api::Realloc => "realloc",
            Api::Reallocarray => "reallocarray",
            Api::PosixMemalign => "posix_memalign",
            Api::AlignedAlloc => "aligned_alloc",
            Api::Memalign => "memalign",
            Api::Valloc => "valloc",
            Api::Pvalloc => "pvalloc",
        }
    }

    pub fn from_bits(b: u8) -> Api {
        Api::ALL.get(b as usize).copied().unwrap_or(Api::Malloc)
    }

    /// A realloc-family result completes the release published before the call.
    pub fn is_realloc(self) -> bool {
        matches!(self, Api::Realloc | Api::Reallocarray)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum EventKind {
    /// A block was handed out (published after the real allocator returned).
    Alloc = 1,
    /// A block is about to be freed (published before the real free runs).
    Free = 2,
    /// A realloc is about to run on `addr`: the block leaves the live set for now.
    ReallocRelease = 3,
    /// The realloc failed: the released block is live again.
    ReallocRestore = 4,
    /// The realloc freed the block without a new one (`realloc(p, 0)`).
    ReallocFreed = 5,
}

impl EventKind {
    /// Events about an address that another thread may touch next: they take a ticket
    /// in the address's bucket (see `hotpath::channel`).
    pub fn orders_by_address(self) -> bool {
        matches!(self, EventKind::Alloc | EventKind::Free | EventKind::ReallocRelease)
    }

    pub fn from_bits(b: u8) -> Option<EventKind> {
        Some(match b {
            1 => EventKind::Alloc,
            2 => EventKind::Free,
            3 => EventKind::ReallocRelease,
            4 => EventKind::ReallocRestore,
            5 => EventKind::ReallocFreed,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub api: Api,
    pub tid: u32,
    pub stack: u32,
    pub addr: u64,
    pub size: u64,
}

impl Event {
    pub fn pack_meta(&self) -> u64 {
        (self.stack as u64)
            | (((self.tid & 0x00ff_ffff) as u64) << 32)
            | ((self.kind as u64 & 0xf) << 56)
            | ((self.api as u64 & 0xf) << 60)
    }

    pub fn unpack(meta: u64, addr: u64, size: u64) -> Option<Event> {
        Some(Event {
            kind: EventKind::from_bits(((meta >> 56) & 0xf) as u8)?,
            api: Api::from_bits(((meta >> 60) & 0xf) as u8),
            tid: ((meta >> 32) & 0x00ff_ffff) as u32,
            stack: meta as u32,
            addr,
            size,
        })
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
                size: 12345,
            };
            assert_eq!(Event::unpack(e.pack_meta(), e.addr, e.size), Some(e));
        }
    }

    #[test]
    fn unknown_kind_is_rejected() {
        assert_eq!(Event::unpack(0, 1, 2), None);
    }
}
