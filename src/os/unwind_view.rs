//! A module's `.eh_frame` read from its file, where the module keeps it in a writable
//! segment: a view of ours, not the program's pages.
//!
//! The unwinder reads each module's call-frame information where the loader mapped it,
//! and `os::unwind_tables` gives those pages back once read. It cannot where the tables
//! lie in a writable segment (the loader writes relocations there before `PT_GNU_RELRO`
//! makes it read-only, and a page it wrote is the program's own): `libnvrtc.so` of the
//! CUDA wheels keeps its 6.5 MB `.eh_frame` so, and `import torch` left 3.6 MB of it
//! resident for good, all read by the unwinder alone. Such a module's `.eh_frame` is
//! read instead from a private read-only mapping of its file, made at the unwinder's
//! first read of it, whose pages the collector gives back with the rest
//! (`release`): the program's own pages of it are never touched.
//!
//! The file's bytes are the loaded ones, checked before the view is used:
//! - the file is the module: its program headers are the loaded module's, byte for
//!   byte, and so is its GNU build ID (a module without one keeps reading memory);
//! - no dynamic relocation (`DT_RELA`, `DT_REL`, `DT_JMPREL`, `DT_RELR`) writes inside
//!   the section, and the module has no text relocations: what the loader changed in
//!   memory is exactly what relocations say;
//! - the section (from the file's section headers, whose address is the one the
//!   module's `.eh_frame_hdr` points to) lies in the segment's file-backed part.
//!
//! Made on the program's thread inside a hook: raw system calls only (no lookup, no
//! allocation, errno kept), and never under a seccomp filter. Views are never unmapped
//! (a reader may be inside one); at most `SLOTS` of them, keyed by the section's address
//! and the module's build ID, so a module loaded again at the same place is checked
//! again.
use std::ffi::c_char;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

const PAGE: usize = 4096;
use libc::{PF_W, PT_DYNAMIC, PT_LOAD, PT_NOTE};
const SHT_PROGBITS: u32 = 1;
const NT_GNU_BUILD_ID: u32 = 3;
const PHDR_SIZE: usize = 56;
const SHDR_SIZE: usize = 64;
/// The longest build ID taken (SHA-1's 20 bytes is the usual; md5 16, uuid 16).
const BUILD_ID_MAX: usize = 64;

const DT_NULL: u64 = 0;
const DT_PLTRELSZ: u64 = 2;
const DT_RELA: u64 = 7;
const DT_RELASZ: u64 = 8;
const DT_RELAENT: u64 = 9;
const DT_REL: u64 = 17;
const DT_RELSZ: u64 = 18;
const DT_RELENT: u64 = 19;
const DT_PLTREL: u64 = 20;
const DT_JMPREL: u64 = 23;
const DT_RELRSZ: u64 = 35;
const DT_RELR: u64 = 36;

/// Little-endian reads of a byte slice, `None` out of bounds (the file may be anything).
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// One program header's fields that matter here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Phdr {
    p_type: u32,
    flags: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

fn phdr(b: &[u8]) -> Option<Phdr> {
    Some(Phdr { p_type: u32_at(b, 0)?, flags: u32_at(b, 4)?, offset: u64_at(b, 8)?, vaddr: u64_at(b, 16)?, filesz: u64_at(b, 32)? })
}

/// The program headers of the ELF image whose first bytes are `image` (an x86-64
/// ELF64 header at its start), as raw bytes.
fn phdr_bytes(image: &[u8]) -> Option<&[u8]> {
    if image.get(..5)? != b"\x7fELF\x02" || u16_at(image, 54)? as usize != PHDR_SIZE {
        return None;
    }
    let (off, n) = (u64_at(image, 32)? as usize, u16_at(image, 56)? as usize);
    if n == 0 || n > 64 {
        return None;
    }
    image.get(off..off.checked_add(n * PHDR_SIZE)?)
}

fn phdrs(bytes: &[u8]) -> impl Iterator<Item = Phdr> + '_ {
    bytes.chunks_exact(PHDR_SIZE).filter_map(phdr)
}

/// The GNU build ID among the notes `notes` (one `PT_NOTE` segment's bytes).
fn build_id_in(notes: &[u8]) -> Option<&[u8]> {
    let mut at = 0usize;
    while at + 12 <= notes.len() {
        let (namesz, descsz, kind) = (u32_at(notes, at)? as usize, u32_at(notes, at + 4)? as usize, u32_at(notes, at + 8)?);
        let name_at = at + 12;
        let desc_at = name_at.checked_add(namesz.checked_add(3)? & !3)?;
        let next = desc_at.checked_add(descsz.checked_add(3)? & !3)?;
        if kind == NT_GNU_BUILD_ID && notes.get(name_at..name_at + namesz)? == b"GNU\0" {
            let id = notes.get(desc_at..desc_at.checked_add(descsz)?)?;
            return (!id.is_empty() && id.len() <= BUILD_ID_MAX).then_some(id);
        }
        at = next;
    }
    None
}

/// Where `vaddr` lies in the file of the segments `phdrs` (file-backed part only).
fn file_offset(ph: &[u8], vaddr: u64, len: u64) -> Option<usize> {
    phdrs(ph)
        .find(|p| p.p_type == PT_LOAD && p.vaddr <= vaddr && vaddr.checked_add(len).is_some_and(|end| end <= p.vaddr + p.filesz))
        .map(|p| (p.offset + (vaddr - p.vaddr)) as usize)
}

/// The file offset and size of the `.eh_frame` section at `eh_frame` (a virtual address
/// of the file's) in the ELF file `file`, if the loaded module with program headers
/// `mem_phdrs` and build ID `mem_build_id` has exactly these bytes there (see the
/// module's comment).
fn checked_section(file: &[u8], mem_phdrs: &[u8], mem_build_id: &[u8], eh_frame: u64) -> Option<(usize, usize)> {
    let file_phdrs = phdr_bytes(file)?;
    if file_phdrs != mem_phdrs {
        return None;
    }
    let file_id = phdrs(file_phdrs).filter(|p| p.p_type == PT_NOTE).find_map(|p| build_id_in(file.get(p.offset as usize..(p.offset + p.filesz) as usize)?));
    if file_id != Some(mem_build_id) {
        return None;
    }
    // The section that starts where `.eh_frame_hdr` points.
    let (shoff, shentsize, shnum) = (u64_at(file, 40)? as usize, u16_at(file, 58)? as usize, u16_at(file, 60)? as usize);
    if shentsize != SHDR_SIZE {
        return None;
    }
    let headers = file.get(shoff..shoff.checked_add(shnum.checked_mul(SHDR_SIZE)?)?)?;
    let (offset, size) = headers.chunks_exact(SHDR_SIZE).find_map(|s| {
        (u32_at(s, 4)? == SHT_PROGBITS && u64_at(s, 16)? == eh_frame && u64_at(s, 32)? > 0).then_some((u64_at(s, 24)? as usize, u64_at(s, 32)? as usize))
    })?;
    // In the segment's file-backed part, where the loader mapped those bytes.
    if file_offset(file_phdrs, eh_frame, size as u64)? != offset || offset.checked_add(size)? > file.len() {
        return None;
    }
    if relocated_within(file, file_phdrs, eh_frame, eh_frame + size as u64)? {
        return None;
    }
    Some((offset, size))
}

/// Whether a dynamic relocation of the file writes inside `[start, end)` (or the module
/// has text relocations); `None` where its tables cannot be read.
fn relocated_within(file: &[u8], file_phdrs: &[u8], start: u64, end: u64) -> Option<bool> {
    let Some(dynamic) = phdrs(file_phdrs).find(|p| p.p_type == PT_DYNAMIC) else {
        // No dynamic section: nothing relocates it.
        return Some(false);
    };
    let entries = file.get(dynamic.offset as usize..(dynamic.offset.checked_add(dynamic.filesz)?) as usize)?;
    let dynamic = || entries.chunks_exact(16).filter_map(|e| Some((u64_at(e, 0)?, u64_at(e, 8)?)));
    if super::unwind_tables::has_textrel(dynamic().map(|(t, v)| (t as i64, v))) {
        return Some(true);
    }
    let mut tag = [0u64; 37];
    let mut seen = [false; 37];
    for (t, v) in dynamic() {
        if t == DT_NULL {
            break;
        }
        if let Some(slot) = tag.get_mut(t as usize) {
            *slot = v;
            seen[t as usize] = true;
        }
    }
    let inside = |at: u64| start <= at && at < end;
    let table = |addr_tag: u64, size_tag: u64| -> Option<Option<&[u8]>> {
        if !seen[addr_tag as usize] {
            return Some(None);
        }
        let size = tag[size_tag as usize];
        let off = file_offset(file_phdrs, tag[addr_tag as usize], size)?;
        Some(Some(file.get(off..off.checked_add(size as usize)?)?))
    };
    // Each entry of these starts with its place (`r_offset`).
    let rela_ent = if seen[DT_RELAENT as usize] { tag[DT_RELAENT as usize] as usize } else { 24 };
    let rel_ent = if seen[DT_RELENT as usize] { tag[DT_RELENT as usize] as usize } else { 16 };
    let plt_ent = if tag[DT_PLTREL as usize] == DT_REL { rel_ent } else { rela_ent };
    for (addr_tag, size_tag, ent) in [(DT_RELA, DT_RELASZ, rela_ent), (DT_REL, DT_RELSZ, rel_ent), (DT_JMPREL, DT_PLTRELSZ, plt_ent)] {
        if ent < 8 {
            return None;
        }
        if let Some(t) = table(addr_tag, size_tag)? {
            if t.chunks_exact(ent).any(|r| u64_at(r, 0).is_none_or(inside)) {
                return Some(true);
            }
        }
    }
    // RELR: an even word is a place (the next one follows it), an odd word a bitmap of
    // the 63 words after the last place.
    if let Some(t) = table(DT_RELR, DT_RELRSZ)? {
        let mut next = 0u64;
        for w in t.chunks_exact(8).filter_map(|w| u64_at(w, 0)) {
            if w & 1 == 0 {
                if inside(w) {
                    return Some(true);
                }
                next = w.wrapping_add(8);
            } else {
                if (1..64).any(|bit| w >> bit & 1 == 1 && inside(next.wrapping_add((bit - 1) * 8))) {
                    return Some(true);
                }
                next = next.wrapping_add(63 * 8);
            }
        }
    }
    Some(false)
}

// ---- the views -----------------------------------------------------------------------

const SLOTS: usize = 16;
const EMPTY: u32 = 0;
const BUSY: u32 = 1;
const READY: u32 = 2;
/// The module's file could not serve (see the module's comment): memory is read.
const REFUSED: u32 = 3;

struct Slot {
    state: AtomicU32,
    /// The section's address in the process, and the module's build ID hashed: the key.
    eh_frame: AtomicU64,
    build_id: AtomicU64,
    /// The section's bytes in the view, and the view's mapping (page-aligned).
    at: AtomicUsize,
    len: AtomicUsize,
    mapping: AtomicUsize,
    mapping_len: AtomicUsize,
}

static VIEWS: [Slot; SLOTS] = [const {
    Slot {
        state: AtomicU32::new(EMPTY),
        eh_frame: AtomicU64::new(0),
        build_id: AtomicU64::new(0),
        at: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        mapping: AtomicUsize::new(0),
        mapping_len: AtomicUsize::new(0),
    }
}; SLOTS];

fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The loaded module's program headers, read from its first page (where its ELF header
/// is mapped: `map_start`, its lowest address).
///
/// # Safety
/// `[map_start, map_end)` must be the mapping of a loaded module (as `_dl_find_object`
/// gives it), mapped while the caller runs code of it or holds it loaded.
unsafe fn loaded_phdrs(map_start: u64, map_end: u64) -> Option<&'static [u8]> {
    let span = map_end.checked_sub(map_start)? as usize;
    // The first page holds the ELF header and, in every linker's layout, the program
    // headers; only what lies inside the module is read.
    let first = span.min(PAGE);
    // SAFETY: the module's first page is mapped and readable (the caller's contract).
    phdr_bytes(unsafe { std::slice::from_raw_parts(map_start as *const u8, first) })
}

/// The loaded module's GNU build ID, from its notes (`ph`: its program headers; `base`:
/// its load bias).
///
/// # Safety
/// As `loaded_phdrs`.
unsafe fn loaded_build_id(ph: &[u8], map_start: u64, map_end: u64, base: u64) -> Option<&'static [u8]> {
    phdrs(ph).filter(|p| p.p_type == PT_NOTE).find_map(|p| {
        let at = base.checked_add(p.vaddr)?;
        if at < map_start || at.checked_add(p.filesz)? > map_end || p.filesz > 4096 {
            return None;
        }
        // SAFETY: a note segment inside the module's mapping (checked just above).
        build_id_in(unsafe { std::slice::from_raw_parts(at as *const u8, p.filesz as usize) })
    })
}

/// The `.eh_frame` at `eh_frame` of the module mapped at `[map_start, map_end)` with load
/// bias `base`, from a view of its file, when the module keeps it in a writable segment
/// and its file has the same bytes; `None`: read the module's memory.
///
/// # Safety
/// As `loaded_phdrs`; `name` is the loader's NUL-terminated path of the module
/// (`l_name`, "" or null for the main program).
pub unsafe fn eh_frame(map_start: u64, map_end: u64, base: u64, name: *const c_char, eh_frame: u64) -> Option<&'static [u8]> {
    // SAFETY: the caller's contract.
    let mem_phdrs = unsafe { loaded_phdrs(map_start, map_end) }?;
    let vaddr = eh_frame.checked_sub(base)?;
    let writable = phdrs(mem_phdrs).any(|p| p.p_type == PT_LOAD && p.flags & PF_W != 0 && p.vaddr <= vaddr && vaddr < p.vaddr + p.filesz);
    if !writable {
        // Nearly every module: its tables are given back by `unwind_tables`.
        return None;
    }
    // SAFETY: the caller's contract.
    let build_id = unsafe { loaded_build_id(mem_phdrs, map_start, map_end, base) }?;
    let key = hash(build_id);
    for slot in &VIEWS {
        let state = slot.state.load(Ordering::Acquire);
        if (state == READY || state == REFUSED) && slot.eh_frame.load(Ordering::Relaxed) == eh_frame && slot.build_id.load(Ordering::Relaxed) == key {
            if state == REFUSED {
                return None;
            }
            // SAFETY: a view of ours, never unmapped, `len` bytes at `at`.
            return Some(unsafe { std::slice::from_raw_parts(slot.at.load(Ordering::Relaxed) as *const u8, slot.len.load(Ordering::Relaxed)) });
        }
    }
    let slot = VIEWS
        .iter()
        .find(|s| s.state.load(Ordering::Relaxed) == EMPTY && s.state.compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
    slot.eh_frame.store(eh_frame, Ordering::Relaxed);
    slot.build_id.store(key, Ordering::Relaxed);
    // SAFETY: `name` per the caller's contract.
    let made = unsafe { make_view(name, mem_phdrs, build_id, vaddr) };
    match made {
        Some((mapping, mapping_len, at, len)) => {
            slot.mapping.store(mapping, Ordering::Relaxed);
            slot.mapping_len.store(mapping_len, Ordering::Relaxed);
            slot.at.store(at, Ordering::Relaxed);
            slot.len.store(len, Ordering::Relaxed);
            slot.state.store(READY, Ordering::Release);
            // SAFETY: as above.
            Some(unsafe { std::slice::from_raw_parts(at as *const u8, len) })
        }
        None => {
            slot.state.store(REFUSED, Ordering::Release);
            None
        }
    }
}

/// A raw `mmap` (no hook of ours or anyone's), `None` on failure.
fn map(len: usize, fd: i32, offset: usize) -> Option<usize> {
    // SAFETY: a new private read-only file mapping; failure is checked.
    let p = unsafe { libc::syscall(libc::SYS_mmap, 0usize, len, libc::PROT_READ, libc::MAP_PRIVATE, fd, offset) };
    // `syscall` answers -1 (and errno) on failure.
    (p != -1).then_some(p as usize)
}

fn unmap(p: usize, len: usize) {
    // SAFETY: a mapping made by `map` above, no longer referred to.
    unsafe { libc::syscall(libc::SYS_munmap, p, len) };
}

/// Opens the module's file, checks it (`checked_section`) through a temporary mapping of
/// all of it, and maps the section's pages: (mapping, its length, section start, length).
///
/// # Safety
/// `name`: null or a NUL-terminated string.
unsafe fn make_view(name: *const c_char, mem_phdrs: &[u8], build_id: &[u8], vaddr: u64) -> Option<(usize, usize, usize, usize)> {
    let _errno = super::ErrnoGuard::save();
    if !super::procfs::unfiltered_without_allocating() {
        return None;
    }
    // SAFETY: per the contract, a readable C string when not null.
    let path = if name.is_null() || unsafe { *name } == 0 { c"/proc/self/exe".as_ptr() } else { name };
    // SAFETY: a NUL-terminated path; a new descriptor of ours, closed below.
    let fd = unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path, libc::O_RDONLY | libc::O_CLOEXEC) } as i32;
    if fd < 0 {
        return None;
    }
    let view = (|| {
        let size = super::fds::stat(fd)?.st_size as usize;
        if size < PAGE {
            return None;
        }
        let whole = map(size, fd, 0)?;
        // SAFETY: the mapping just made, `size` bytes of the file, read-only.
        let file = unsafe { std::slice::from_raw_parts(whole as *const u8, size) };
        let checked = checked_section(file, mem_phdrs, build_id, vaddr);
        unmap(whole, size);
        let (offset, len) = checked?;
        let first = offset & !(PAGE - 1);
        let mapping_len = (offset + len).div_ceil(PAGE) * PAGE - first;
        let view = map(mapping_len, fd, first)?;
        // Read a few FDEs at a time: no read-ahead.
        // SAFETY: advice on the mapping just made.
        unsafe { libc::syscall(libc::SYS_madvise, view, mapping_len, libc::MADV_RANDOM) };
        super::own::mapped_file(view, mapping_len, super::own::Part::Unwind);
        Some((view, mapping_len, view + (offset - first), len))
    })();
    // SAFETY: the descriptor opened above (the mappings keep the file).
    unsafe { libc::syscall(libc::SYS_close, fd) };
    view
}

/// Gives back the pages the unwinder read through the views (they stay in the page
/// cache; the next read maps them again). The collector's, with `unwind_tables`'s.
pub fn release() {
    let _errno = super::ErrnoGuard::save();
    for slot in &VIEWS {
        if slot.state.load(Ordering::Acquire) == READY {
            // SAFETY: a private read-only file mapping of ours that nothing writes:
            // dropping its pages loses nothing.
            unsafe { libc::syscall(libc::SYS_madvise, slot.mapping.load(Ordering::Relaxed), slot.mapping_len.load(Ordering::Relaxed), libc::MADV_DONTNEED) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little ELF file: a read-only segment at file offset 0 (the notes, a RELA table)
    /// and a writable one at file offset 0x1000, loaded at 0x2000, that holds `.eh_frame`
    /// (0x2100, 0x200 bytes) and the dynamic section (0x2800).
    struct Elf {
        bytes: Vec<u8>,
    }

    const EH: u64 = 0x2100;
    const EH_SIZE: u64 = 0x200;
    const ID: [u8; 20] = [7; 20];

    impl Elf {
        fn put(&mut self, at: usize, v: &[u8]) {
            self.bytes[at..at + v.len()].copy_from_slice(v);
        }
        fn u64(&mut self, at: usize, v: u64) {
            self.put(at, &v.to_le_bytes());
        }
        fn u32(&mut self, at: usize, v: u32) {
            self.put(at, &v.to_le_bytes());
        }
        fn u16(&mut self, at: usize, v: u16) {
            self.put(at, &v.to_le_bytes());
        }
        fn phdr(&mut self, k: usize, p_type: u32, flags: u32, offset: u64, vaddr: u64, size: u64) {
            let at = 64 + k * PHDR_SIZE;
            self.u32(at, p_type);
            self.u32(at + 4, flags);
            self.u64(at + 8, offset);
            self.u64(at + 16, vaddr);
            self.u64(at + 32, size);
            self.u64(at + 40, size);
        }
        /// The dynamic section's entries (a `DT_NULL` after them).
        fn dynamic(&mut self, entries: &[(u64, u64)]) {
            for (k, &(t, v)) in entries.iter().chain(&[(DT_NULL, 0)]).enumerate() {
                self.u64(0x1800 + k * 16, t);
                self.u64(0x1808 + k * 16, v);
            }
        }

        fn new() -> Elf {
            let mut e = Elf { bytes: vec![0; 0x2000 + 2 * SHDR_SIZE] };
            e.put(0, b"\x7fELF\x02\x01\x01");
            e.u64(32, 64);
            e.u64(40, 0x2000);
            e.u16(54, PHDR_SIZE as u16);
            e.u16(56, 4);
            e.u16(58, SHDR_SIZE as u16);
            e.u16(60, 2);
            e.phdr(0, PT_LOAD, 4, 0, 0, 0x1000);
            e.phdr(1, PT_LOAD, 6, 0x1000, 0x2000, 0x1000);
            e.phdr(2, PT_DYNAMIC, 6, 0x1800, 0x2800, 0x100);
            e.phdr(3, PT_NOTE, 4, 0x400, 0x400, 20 + 36);
            // A note before the build ID, then the build ID.
            e.u32(0x400, 4);
            e.u32(0x404, 4);
            e.u32(0x408, 5);
            e.put(0x40c, b"GNU\0");
            e.put(0x410, &[1, 2, 3, 4]);
            e.u32(0x414, 4);
            e.u32(0x418, 20);
            e.u32(0x41c, NT_GNU_BUILD_ID);
            e.put(0x420, b"GNU\0");
            e.put(0x424, &ID);
            // RELA: two places just outside the section.
            e.u64(0x500, EH - 8);
            e.u64(0x518, EH + EH_SIZE);
            e.dynamic(&[(DT_RELA, 0x500), (DT_RELASZ, 48), (DT_RELAENT, 24)]);
            // Section headers: the null one, `.eh_frame`.
            let s = 0x2000 + SHDR_SIZE;
            e.u32(s + 4, SHT_PROGBITS);
            e.u64(s + 16, EH);
            e.u64(s + 24, 0x1100);
            e.u64(s + 32, EH_SIZE);
            e
        }

        fn check(&self) -> Option<(usize, usize)> {
            checked_section(&self.bytes, phdr_bytes(&self.bytes).unwrap(), &ID, EH)
        }
    }

    #[test]
    fn the_section_of_a_matching_file_with_no_relocation_in_it_is_read_from_the_file() {
        let e = Elf::new();
        assert_eq!(e.check(), Some((0x1100, EH_SIZE as usize)));
        assert_eq!(build_id_in(&e.bytes[0x400..0x438]), Some(&ID[..]));
        // Other loaded program headers, another build ID, another section address: the
        // file is not what was loaded.
        let mut other = phdr_bytes(&e.bytes).unwrap().to_vec();
        other[16] ^= 1;
        assert_eq!(checked_section(&e.bytes, &other, &ID, EH), None);
        assert_eq!(checked_section(&e.bytes, phdr_bytes(&e.bytes).unwrap(), &[7; 19], EH), None);
        assert_eq!(checked_section(&e.bytes, phdr_bytes(&e.bytes).unwrap(), &ID, EH + 8), None);
        // A file cut short, or no ELF at all.
        assert_eq!(checked_section(&e.bytes[..0x1200], phdr_bytes(&e.bytes).unwrap(), &ID, EH), None);
        assert_eq!(phdr_bytes(&[0u8; 128]), None);
    }

    #[test]
    fn a_relocation_inside_the_section_or_text_relocations_keep_memory_read() {
        // RELA, its first and last byte.
        for place in [EH, EH + EH_SIZE - 1] {
            let mut e = Elf::new();
            e.u64(0x518, place);
            assert_eq!(e.check(), None, "{place:#x}");
        }
        // REL (16-byte entries) and the PLT's relocations.
        let mut e = Elf::new();
        e.u64(0x600, 0x2000);
        e.u64(0x610, EH + 0x10);
        e.dynamic(&[(DT_REL, 0x600), (DT_RELSZ, 32)]);
        assert_eq!(e.check(), None);
        e.dynamic(&[(DT_JMPREL, 0x600), (DT_PLTRELSZ, 32), (DT_PLTREL, DT_REL)]);
        assert_eq!(e.check(), None);
        e.dynamic(&[(DT_REL, 0x600), (DT_RELSZ, 16)]);
        assert_eq!(e.check(), Some((0x1100, EH_SIZE as usize)), "only the first entry, outside");
        // Text relocations, either way of saying so.
        use crate::os::unwind_tables::{DF_TEXTREL, DT_FLAGS, DT_TEXTREL};
        e.dynamic(&[(DT_TEXTREL as u64, 0)]);
        assert_eq!(e.check(), None);
        e.dynamic(&[(DT_FLAGS as u64, DF_TEXTREL)]);
        assert_eq!(e.check(), None);
        // A relocation table that is not in the file: cannot tell.
        e.dynamic(&[(DT_RELA, 0x9000), (DT_RELASZ, 24)]);
        assert_eq!(e.check(), None);
    }

    #[test]
    fn relr_places_and_bitmaps_are_both_read() {
        let mut e = Elf::new();
        e.dynamic(&[(DT_RELR, 0x700), (DT_RELRSZ, 16)]);
        // A place 16 bytes before the section; a bitmap of the words after it: bit 1 is
        // the word at EH - 8 (outside), bit 3 the word at EH + 8 (inside).
        e.u64(0x700, EH - 16);
        e.u64(0x708, 1 | 1 << 1);
        assert_eq!(e.check(), Some((0x1100, EH_SIZE as usize)));
        e.u64(0x708, 1 | 1 << 3);
        assert_eq!(e.check(), None);
        // A place inside.
        e.u64(0x700, EH + 0x40);
        e.u64(0x708, 0);
        assert_eq!(e.check(), None);
        // A second bitmap covers the 63 words after the first one's: from a place 0x200
        // bytes before the section, the first bitmap's words end where it starts.
        e.dynamic(&[(DT_RELR, 0x700), (DT_RELRSZ, 24)]);
        e.u64(0x700, EH - 0x200);
        e.u64(0x708, 1 | 1 << 63);
        e.u64(0x710, 1);
        assert_eq!(e.check(), Some((0x1100, EH_SIZE as usize)), "the first bitmap's last word is EH - 8");
        e.u64(0x710, 1 | 1 << 3);
        assert_eq!(e.check(), None, "the second bitmap's third word is EH + 16");
    }

    #[test]
    fn the_seccomp_state_read_without_allocating_is_the_one_read_with() {
        super::super::procfs::open(false);
        let text = super::super::procfs::status();
        if text.is_empty() {
            return crate::test_skip::skip_not_here("no /proc/self/status");
        }
        assert_eq!(super::super::procfs::unfiltered_without_allocating(), super::super::procfs::unfiltered(&text));
    }
}
