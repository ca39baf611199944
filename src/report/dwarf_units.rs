//! DWARF of one compilation unit at a time, for a module with a large `.debug_info`
//! (`BY_UNIT_MIN_BYTES`), first for those whose units addr2line could only find
//! through a table of all their ranges.
//!
//! addr2line's context keeps, for the whole file, every address range of every unit:
//! 32 bytes a range. A file without `.debug_aranges` whose units list a range per
//! function (`-ffunction-sections`) has hundreds of thousands: triton's `libtriton.so`
//! (142 MB of `.debug_info`, 307 units, 9.6 MB of `.debug_ranges`), which `import torch`
//! loads and whose static constructors allocate: its context, with the units a report
//! had parsed, held ~44 MB of the library's heap in the PyTorch job from the first
//! report that named one of its frames until the process ended.
//!
//! Here a unit's ranges are merged where they touch (a unit's functions lie together
//! in the file's text) into a small table of our own, and the report's addresses of one
//! unit are looked up in a context of that unit alone, dropped after the report's
//! batch. That context reads a copy of `.debug_info` in which the unit stands at its own
//! offset (references between entries stay valid) and everything before it is one
//! empty type unit, which addr2line passes over: a reference into another unit finds
//! no unit and gives no name, never a wrong one. The copy is a zeroed mapping (the
//! library's large buffers are), so only the unit's own pages are written.
//!
//! Plain safe Rust but for one lifetime (`OneUnit`) and a fallible zeroed allocation
//! (`zeroed`); unit tests below.
use gimli::{EndianSlice, RunTimeEndian};

pub type Reader = EndianSlice<'static, RunTimeEndian>;

/// `.debug_info` of at least this size is read by unit, with or without
/// `.debug_aranges`: with them, addr2line's context still parses every unit's
/// abbreviations up front and keeps the lines and functions of each unit a lookup went
/// into. Python's own library as pyenv builds it (8.8 MB of `.debug_info`, with
/// aranges) held ~10 MB of our heap so in `import torch`, from a report's lookups to
/// the end of the report, and the final report, at the program's peak, read it again.
pub const BY_UNIT_MIN_BYTES: usize = 4 << 20;

/// `UnitIndex::build` gives the file's pages back after this many units.
const RELEASE_EVERY_UNITS: usize = 8;

/// Addresses `[begin, end)` of the unit at `offset` (its entries end at `end_offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    begin: u64,
    end: u64,
    offset: usize,
    end_offset: usize,
}

/// The units' merged ranges, by address.
#[derive(Debug, Default)]
pub struct UnitIndex {
    spans: Vec<Span>,
}

impl UnitIndex {
    /// Every compilation unit's ranges, read once (each unit's abbreviations and root
    /// entry, then dropped), with `release` called every `RELEASE_EVERY_UNITS` units and
    /// at the end: the pass reads the file's mapping, whose pages count in the process's
    /// RSS while mapped (libtriton's made a transient of ~50 MB, at the PyTorch job's
    /// peak when its first naming came with the final report).
    pub fn build(sections: &gimli::Dwarf<Reader>, mut release: impl FnMut()) -> UnitIndex {
        let mut spans = Vec::new();
        let mut units = sections.units();
        let mut ranges = Vec::new();
        let mut read = 0usize;
        while let Ok(Some(header)) = units.next() {
            read += 1;
            if read.is_multiple_of(RELEASE_EVERY_UNITS) {
                release();
            }
            let Some(offset) = header.debug_info_offset() else { continue };
            if !matches!(header.type_(), gimli::UnitType::Compilation | gimli::UnitType::Skeleton(_)) {
                continue;
            }
            let end_offset = offset.0 + header.length_including_self();
            let Ok(unit) = sections.unit(header) else { continue };
            let Ok(mut iter) = sections.unit_ranges(&unit) else { continue };
            ranges.clear();
            while let Ok(Some(r)) = iter.next() {
                if r.begin < r.end {
                    ranges.push((r.begin, r.end));
                }
            }
            merge_into(&mut spans, &mut ranges, offset.0, end_offset);
        }
        release();
        spans.sort_unstable_by_key(|s: &Span| (s.begin, s.offset));
        spans.shrink_to_fit();
        UnitIndex { spans }
    }

    /// The unit (`.debug_info` offset and end) whose ranges hold `probe`.
    pub fn unit_of(&self, probe: u64) -> Option<(usize, usize)> {
        let after = self.spans.partition_point(|s| s.begin <= probe);
        // Units' ranges rarely overlap; look back a little for one that does.
        self.spans[..after].iter().rev().take(16).find(|s| probe < s.end).map(|s| (s.offset, s.end_offset))
    }

    /// Merged ranges held (for tests and diagnostics).
    pub fn spans(&self) -> usize {
        self.spans.len()
    }
}

/// Adds a unit's `ranges` (any order) to `spans`, merged where they touch or overlap.
fn merge_into(spans: &mut Vec<Span>, ranges: &mut [(u64, u64)], offset: usize, end_offset: usize) {
    ranges.sort_unstable();
    let first = spans.len();
    for &(begin, end) in ranges.iter() {
        match spans[first..].last_mut() {
            Some(last) if begin <= last.end => last.end = last.end.max(end),
            _ => spans.push(Span { begin, end, offset, end_offset }),
        }
    }
}

/// The header of an empty DWARF 5 type unit: 4 bytes of length, version, unit type,
/// address size, abbreviations offset, signature and type offset.
const FILLER_HEADER: usize = 24;

/// A copy of `info` (`.debug_info`) up to `end` in which the unit at `offset` is where
/// it was and all before it is one empty type unit (or, before the filler's header
/// fits, the units there as they were). `None` if the range is not in `info`.
pub fn unit_alone(info: &[u8], offset: usize, end: usize, big_endian: bool) -> Option<Vec<u8>> {
    let unit = info.get(offset..end)?;
    let mut out = zeroed(end)?;
    out[offset..].copy_from_slice(unit);
    if offset < FILLER_HEADER {
        out[..offset].copy_from_slice(&info[..offset]);
        return Some(out);
    }
    let length = u32::try_from(offset - 4).ok()?;
    let mut header = [0u8; FILLER_HEADER];
    let (length, version) = if big_endian { (length.to_be_bytes(), 5u16.to_be_bytes()) } else { (length.to_le_bytes(), 5u16.to_le_bytes()) };
    header[0..4].copy_from_slice(&length);
    header[4..6].copy_from_slice(&version);
    header[6] = gimli::constants::DW_UT_type.0;
    header[7] = 8;
    // Abbreviations at 0, signature 0, type offset 0: never read (addr2line passes over
    // type units before parsing them).
    out[..FILLER_HEADER].copy_from_slice(&header);
    Some(out)
}

/// `len` zero bytes, or `None` where the allocator has none: zeroed pages, mapped and
/// not written (`RealAllocator` maps large zeroed blocks), so only what is written
/// becomes resident. Not `vec![0; len]`, which would end the program where a mapping of
/// the whole `.debug_info`'s size is refused (an address-space limit).
fn zeroed(len: usize) -> Option<Vec<u8>> {
    let layout = std::alloc::Layout::array::<u8>(len).ok().filter(|l| l.size() > 0)?;
    // SAFETY: a layout of nonzero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is a fresh allocation of the global allocator of `len` zeroed bytes
    // with `u8`'s layout: a vector of that length and capacity owns it.
    Some(unsafe { Vec::from_raw_parts(p, len, len) })
}

/// A context of one unit (`unit_alone`) and the copy it reads.
pub struct OneUnit {
    /// Declared before `_info`: dropped first, while what it borrows is still there.
    pub ctx: addr2line::Context<Reader>,
    pub offset: usize,
    _info: Vec<u8>,
}

impl OneUnit {
    /// The unit at `offset..end` of `sections`' `.debug_info`, alone.
    pub fn open(sections: &gimli::DwarfSections<Reader>, offset: usize, end: usize, endian: RunTimeEndian) -> Option<OneUnit> {
        use gimli::Section;
        let info = unit_alone(sections.debug_info.reader().slice(), offset, end, endian == RunTimeEndian::Big)?;
        // SAFETY: the slice points into `info`'s heap buffer, which stays where it is
        // (a `Vec` moved keeps its buffer) and lives in the same `OneUnit` as the
        // context that reads it, dropped after it (fields drop in order); nothing
        // else holds the context or the slice.
        let data: &'static [u8] = unsafe { std::slice::from_raw_parts(info.as_ptr(), info.len()) };
        let mut dwarf = sections.borrow(|s| *s);
        dwarf.debug_info = gimli::DebugInfo::from(EndianSlice::new(data, endian));
        let ctx = addr2line::Context::from_dwarf(dwarf).ok()?;
        Some(OneUnit { ctx, offset, _info: info })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_units_ranges_merge_where_they_touch_and_units_are_found_by_address() {
        let mut spans = Vec::new();
        merge_into(&mut spans, &mut [(30, 40), (10, 20), (20, 25), (12, 18), (50, 60)], 100, 200);
        merge_into(&mut spans, &mut [(40, 50), (70, 80)], 200, 300);
        spans.sort_unstable_by_key(|s: &Span| (s.begin, s.offset));
        let index = UnitIndex { spans };
        assert_eq!(index.spans(), 5, "{index:?}");
        for (probe, unit) in
            [(10, Some(100)), (24, Some(100)), (25, None), (39, Some(100)), (40, Some(200)), (55, Some(100)), (79, Some(200)), (80, None), (5, None)]
        {
            assert_eq!(index.unit_of(probe).map(|u| u.0), unit, "probe {probe}");
        }
    }

    #[test]
    fn a_unit_alone_keeps_its_offset_behind_an_empty_type_unit() {
        let info: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        let out = unit_alone(&info, 100, 150, false).unwrap();
        assert_eq!(out.len(), 150);
        assert_eq!(&out[100..], &info[100..150]);
        let header = gimli::DebugInfo::new(&out, gimli::LittleEndian).units().next().unwrap().unwrap();
        assert_eq!(header.length_including_self(), 100);
        assert!(matches!(header.type_(), gimli::UnitType::Type { .. }));
        assert!(out[FILLER_HEADER..100].iter().all(|&b| b == 0));
        // Too close to the start for the filler: the bytes before stay.
        assert_eq!(unit_alone(&info, 10, 20, false).unwrap(), info[..20].to_vec());
        assert!(unit_alone(&info, 150, 250, false).is_none());
        assert!(zeroed(0).is_none() && zeroed(1 << 20).is_some_and(|z| z.len() == 1 << 20 && z.iter().all(|&b| b == 0)));
    }
}
