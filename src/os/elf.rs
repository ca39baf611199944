//! Symbols read from the loaded modules' own dynamic symbol tables, without asking the
//! loader's `dlsym`/`dlvsym`. This library exports both (a program that looks `malloc`
//! up by hand must get our hook), so its own calls to them would land in its own
//! exports; the real ones are found here instead, once, the way the loader would:
//! the GNU hash table of each module in load order, the default version of the name.
//!
//! Only modules with a `DT_GNU_HASH` table are searched (every glibc since 2.5 and every
//! library a distribution builds has one); a name defined only as an IFUNC or only in a
//! module without one is not found, and the caller falls back.
use std::ffi::{c_void, CStr};

/// The GNU hash of a symbol name (the `DT_GNU_HASH` function: djb2, 32 bits).
pub fn gnu_hash(name: &[u8]) -> u32 {
    name.iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(c as u32))
}

/// Whether a module's GNU hash bloom filter (`bloom`, its 64-bit words; `shift`, its
/// second hash's shift) may hold a name of hash `h`: false means the module does not
/// define it, found without reading its buckets and chains (cold pages in most
/// modules: the start asks after a dozen names that most programs lack). An empty
/// filter admits everything.
fn bloom_admits(bloom: &[u64], shift: u32, h: u32) -> bool {
    if bloom.is_empty() {
        return true;
    }
    let word = bloom[(h / 64) as usize % bloom.len()];
    let mask = 1u64 << (h % 64) | 1u64 << (h.checked_shr(shift).unwrap_or(0) % 64);
    word & mask == mask
}

/// The address of each of `names`' default-version definitions, looked up as
/// `dlsym(RTLD_NEXT, name)` from the module containing `from` would: the first module
/// after it in load order that defines the name, or failing that the first one before
/// it. 0 for a name that no searched module defines.
pub fn next_definitions<const N: usize>(names: [&CStr; N], from: usize) -> [usize; N] {
    definitions(names, from, false).map(Found::address)
}

/// What the modules' own tables say of a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// Its default-version definition, a function or an object.
    At(usize),
    /// Every module was searched and none defines the name, in any version or form:
    /// `dlsym` could only fail. A failed `dlsym` formats an error message in a
    /// `malloc`ed buffer: ~0.5 us each, ~8 us the first one in a process.
    Nowhere,
    /// The tables cannot tell (an IFUNC, a hidden version only, or a module without a
    /// GNU hash table): ask the loader.
    Unknown,
}

impl Found {
    pub fn address(self) -> usize {
        match self {
            Found::At(p) => p,
            _ => 0,
        }
    }
}

/// `next_definitions`, telling a name that no module defines (`Found::Nowhere`) from
/// one that the tables cannot resolve.
pub fn next_definitions_found<const N: usize>(names: [&CStr; N], from: usize) -> [Found; N] {
    definitions(names, from, false)
}

/// Whether `dlsym(RTLD_DEFAULT, name)` can only fail: no module the loader lists
/// defines `name` in any version or form, and every module's tables could tell. One
/// walk of the module list under the loader's lock (`loader::iterate_modules`), so a
/// module unloaded meanwhile is never read; no allocation.
pub fn defined_nowhere(name: &CStr) -> bool {
    each_defined_nowhere([name])[0]
}

/// `defined_nowhere` of each of `names`, in one walk of the module list: the start
/// asks after several names that most programs lack (the sanitizers', cgo's), and each
/// walk reads every module's dynamic section again.
pub fn each_defined_nowhere<const N: usize>(names: [&CStr; N]) -> [bool; N] {
    struct Search<'a, const N: usize> {
        names: [&'a [u8]; N],
        /// Set once a module defines the name or cannot tell.
        maybe: [bool; N],
    }
    unsafe extern "C" fn visit<const N: usize>(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> std::ffi::c_int {
        // SAFETY: `data` is the `Search` passed below; `info` describes a loaded module
        // whose program headers and dynamic section stay mapped while the walk holds
        // the loader's lock.
        unsafe {
            let search = &mut *(data as *mut Search<N>);
            let info = &*info;
            let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() { &[] } else { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
            let base = info.dlpi_addr as usize;
            // A module without a dynamic section exports nothing.
            let Some(dynamic) = super::loader::dynamic_section(base, phdrs) else { return 0 };
            let table = DynamicSymbols::read(base, dynamic);
            for (name, maybe) in search.names.iter().zip(search.maybe.iter_mut()) {
                *maybe = *maybe || table.as_ref().is_none_or(|t| t.defines_any(name));
            }
            // Non-zero ends the walk: every name is found somewhere.
            search.maybe.iter().all(|&m| m) as std::ffi::c_int
        }
    }
    let mut search = Search { names: names.map(CStr::to_bytes), maybe: [false; N] };
    // SAFETY: `visit` treats its data as the `Search` given here, which outlives the walk.
    unsafe { super::loader::iterate_modules(Some(visit::<N>), &mut search as *mut Search<N> as *mut c_void) };
    search.maybe.map(|m| !m)
}

/// The head of `struct link_map` (`<link.h>`): the loader's public, stable part.
#[repr(C)]
struct LinkMap {
    addr: usize,
    name: *const std::ffi::c_char,
    ld: *const Dyn,
    next: *const LinkMap,
    prev: *const LinkMap,
}

/// One walk of the main namespace's modules: `names` after `from` (`within`: false)
/// or in it (true).
///
/// The walk follows the loader's `link_map` list from the module of `from` (`home_of`:
/// `dladdr1`, or this library's, found once) back to its head and then forward, in
/// load order, as `dl_iterate_phdr` would, but without calling it: ThreadSanitizer's
/// runtime intercepts `dl_iterate_phdr`, and its interceptor calls through a null
/// pointer until that runtime has set itself up — which it does by calling `dlsym`,
/// ours, whose first call comes here. It runs once, at the process's first symbol
/// lookup (possibly inside one of our own module walks, or inside another interposer's
/// first `malloc`), takes no lock and allocates nothing.
fn definitions<const N: usize>(names: [&CStr; N], from: usize, within: bool) -> [Found; N] {
    let Some(home) = home_of(from) else { return [Found::Unknown; N] };
    let mut first = home;
    // SAFETY: link_map entries of loaded modules; the list's ends are null.
    while let Some(prev) = unsafe { (*first).prev.as_ref() } {
        first = prev;
    }
    let (mut after, mut before, mut passed) = ([0; N], [0; N], within);
    // Per name: whether a searched module defines it in a form `lookup` does not give;
    // and whether a module's tables could not be read (then no absence is certain).
    let (mut other_forms, mut unreadable) = ([false; N], false);
    let mut m = first;
    while !m.is_null() {
        // SAFETY: as above.
        let module = unsafe { &*m };
        let is_home = std::ptr::eq(m, home);
        if is_home == within && !module.ld.is_null() {
            // SAFETY: l_ld is the module's mapped, DT_NULL-terminated dynamic section.
            match unsafe { DynamicSymbols::read(module.addr, module.ld as usize) } {
                Some(table) => {
                    let found = if passed { &mut after } else { &mut before };
                    for (k, name) in names.iter().enumerate() {
                        if found[k] == 0 {
                            // SAFETY: the tables were just read from this module's dynamic section.
                            found[k] = unsafe { table.lookup(name.to_bytes()) }.unwrap_or(0);
                            // SAFETY: as above.
                            other_forms[k] |= found[k] == 0 && unsafe { table.defines_any(name.to_bytes()) };
                        }
                    }
                }
                None => unreadable = true,
            }
        }
        passed |= is_home;
        m = module.next;
    }
    std::array::from_fn(|k| match (after[k], before[k]) {
        (0, 0) if other_forms[k] || unreadable => Found::Unknown,
        (0, 0) => Found::Nowhere,
        (0, p) | (p, _) => Found::At(p),
    })
}

/// Whether `dlsym(RTLD_DEFAULT, name)` gives this library's own definition of each of
/// `names`, told from the modules' tables alone (no `dlsym`, ~10 us at a process's
/// start): true when no module before this one in load order defines the name in any
/// form and this one defines its default version. A module before this one in load
/// order was loaded before it, as the program started (this library is preloaded, or a
/// module before it defines `malloc`: the C library does): the global scope holds it,
/// in the same order. False where that is not so or a table before ours cannot be
/// read: then ask the loader.
pub fn first_definitions_are_own<const N: usize>(names: [&CStr; N]) -> [bool; N] {
    let mut out = [false; N];
    let Some(own) = home_of(gnu_hash as *const () as usize) else { return out };
    // Per name: decided (a module defines it, or a table could not be read first).
    let mut decided = [false; N];
    let mut m = own;
    // SAFETY: link_map entries of loaded modules; the list's ends are null.
    while let Some(prev) = unsafe { (*m).prev.as_ref() } {
        m = prev;
    }
    while !m.is_null() && !decided.iter().all(|&d| d) {
        // SAFETY: as above.
        let module = unsafe { &*m };
        let is_own = std::ptr::eq(m, own);
        if !module.ld.is_null() {
            // SAFETY: l_ld is the module's mapped, DT_NULL-terminated dynamic section.
            let Some(table) = (unsafe { DynamicSymbols::read(module.addr, module.ld as usize) }) else { return out };
            for (k, name) in names.iter().enumerate() {
                // SAFETY: the tables were just read from this module's dynamic section.
                if !decided[k] && unsafe { table.defines_any(name.to_bytes()) } {
                    decided[k] = true;
                    // SAFETY: as above.
                    out[k] = is_own && unsafe { table.lookup(name.to_bytes()) }.is_some();
                }
            }
        }
        if is_own {
            break;
        }
        m = module.next;
    }
    out
}

/// This library's own `link_map` and the span of its segments, once found
/// (`home_of`): every caller of `definitions` asks from inside it, and `dladdr1` walks
/// the module's symbol table for the nearest symbol each time (~3,500 instructions, four
/// times in every process's start).
static OWN_HOME: std::sync::atomic::AtomicPtr<LinkMap> = std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
static OWN_SPAN: [std::sync::atomic::AtomicUsize; 2] = [std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0)];

/// The `link_map` of the module containing `from`: this library's from the cache, any
/// other's from `dladdr1`. Takes no lock and allocates nothing.
fn home_of(from: usize) -> Option<*const LinkMap> {
    use super::loader::{dladdr1, RTLD_DL_LINKMAP};
    use std::sync::atomic::Ordering;
    let own = OWN_HOME.load(Ordering::Acquire);
    if !own.is_null() && from >= OWN_SPAN[0].load(Ordering::Relaxed) && from < OWN_SPAN[1].load(Ordering::Relaxed) {
        return Some(own);
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let mut home: *mut c_void = std::ptr::null_mut();
    // SAFETY: dladdr1 fills info and, with RTLD_DL_LINKMAP, the module's link_map.
    if unsafe { dladdr1(from as *const c_void, info.as_mut_ptr(), &mut home, RTLD_DL_LINKMAP) } == 0 || home.is_null() {
        return None;
    }
    let home = home as *const LinkMap;
    // SAFETY: dladdr1 succeeded, so info is filled; `dli_fbase` is where the module's
    // first segment, which holds its ELF header, is mapped.
    let header = unsafe { (*info.as_ptr()).dli_fbase } as usize;
    // SAFETY: `home` is the loaded module's link_map (its public head).
    let bias = unsafe { (*home).addr };
    // SAFETY: as above: the ELF header is mapped at `header` while the module is loaded.
    if let Some((lo, hi)) = unsafe { segments_span(header, bias) } {
        let marker = gnu_hash as *const () as usize;
        if marker >= lo && marker < hi {
            // Our own module: never unloaded while its code runs.
            OWN_SPAN[0].store(lo, Ordering::Relaxed);
            OWN_SPAN[1].store(hi, Ordering::Relaxed);
            OWN_HOME.store(home as *mut LinkMap, Ordering::Release);
        }
    }
    Some(home)
}

/// Whether `addr` lies in this library (our exported hooks: never wrapped again). Its
/// span is found once (`home_of`, from this library's own code) and kept; false where
/// it cannot be read. Takes no lock of ours and allocates nothing: it runs inside our
/// `dlsym` and `dlvsym`.
pub fn in_own_module(addr: usize) -> bool {
    use std::sync::atomic::Ordering;
    if OWN_HOME.load(Ordering::Acquire).is_null() {
        home_of(gnu_hash as *const () as usize);
    }
    !OWN_HOME.load(Ordering::Acquire).is_null() && addr >= OWN_SPAN[0].load(Ordering::Relaxed) && addr < OWN_SPAN[1].load(Ordering::Relaxed)
}

/// The span of the PT_LOAD segments of the module whose ELF header is mapped at
/// `header` and whose load bias is `bias`, if the header is a 64-bit ELF header with
/// its program headers inside its first page.
///
/// # Safety
/// `header` must be the mapped start of a loaded module's first segment.
unsafe fn segments_span(header: usize, bias: usize) -> Option<(usize, usize)> {
    // SAFETY: the caller's contract: the first segment is mapped, at least a page.
    let ehdr = unsafe { &*(header as *const libc::Elf64_Ehdr) };
    let phdrs_end = ehdr.e_phoff as usize + ehdr.e_phnum as usize * std::mem::size_of::<libc::Elf64_Phdr>();
    if ehdr.e_ident[..4] != *b"\x7fELF" || ehdr.e_phentsize as usize != std::mem::size_of::<libc::Elf64_Phdr>() || phdrs_end > 4096 {
        return None;
    }
    // SAFETY: checked above to lie within the mapped first page, after the header.
    let phdrs = unsafe { std::slice::from_raw_parts((header + ehdr.e_phoff as usize) as *const libc::Elf64_Phdr, ehdr.e_phnum as usize) };
    let (lo, hi) = super::loader::span(bias, phdrs);
    (lo < hi).then_some((lo, hi))
}

/// The address of each of `names`' definitions in the module containing `within`
/// itself (0 where it defines none). For our own exports: taking the address of an
/// exported function in Rust gives the program's first definition of its name (through
/// the GOT), which is another interposer's when one comes before us.
pub fn own_definitions<const N: usize>(names: [&CStr; N], within: usize) -> [usize; N] {
    definitions(names, within, true).map(Found::address)
}

/// A module's dynamic symbol table, string table, GNU hash table and version table.
struct DynamicSymbols {
    base: usize,
    symtab: *const libc::Elf64_Sym,
    strtab: *const u8,
    strsz: usize,
    gnu_hash: *const u32,
    versym: *const u16,
}

impl DynamicSymbols {
    /// Reads the tables' addresses from the dynamic section at `dynamic`. glibc adds the
    /// load bias to these entries in place, except where the section is read-only (the
    /// vDSO): an address below `base` is taken as not yet relocated.
    ///
    /// # Safety
    /// `dynamic` is the mapped, DT_NULL-terminated dynamic section of the module loaded
    /// at `base`.
    unsafe fn read(base: usize, dynamic: usize) -> Option<DynamicSymbols> {
        let at = |p: u64| relocated(base, p);
        let mut t = DynamicSymbols { base, symtab: std::ptr::null(), strtab: std::ptr::null(), strsz: 0, gnu_hash: std::ptr::null(), versym: std::ptr::null() };
        // SAFETY: the caller's contract.
        unsafe {
            each_entry(dynamic, |tag, value| match tag {
                DT_SYMTAB => t.symtab = at(value) as *const libc::Elf64_Sym,
                DT_STRTAB => t.strtab = at(value) as *const u8,
                DT_STRSZ => t.strsz = value as usize,
                DT_GNU_HASH => t.gnu_hash = at(value) as *const u32,
                DT_VERSYM => t.versym = at(value) as *const u16,
                _ => {}
            })
        };
        (!t.symtab.is_null() && !t.strtab.is_null() && !t.gnu_hash.is_null() && t.strsz > 0).then_some(t)
    }

    /// The address of the default-version, defined, non-IFUNC function or object `name`.
    ///
    /// # Safety
    /// The tables are those of a loaded module, as `read` found them.
    unsafe fn lookup(&self, name: &[u8]) -> Option<usize> {
        // SAFETY: the caller's contract.
        unsafe { self.first_in_chain(name, |i| self.definition(i, name)) }
    }

    /// Whether the module defines `name` at all: in any version, of any type (an IFUNC
    /// too), whatever `dlsym` would make of it.
    ///
    /// # Safety
    /// As `lookup`.
    unsafe fn defines_any(&self, name: &[u8]) -> bool {
        // SAFETY: the caller's contract; the indices come from the hash chains.
        unsafe { self.first_in_chain(name, |i| ((*self.symtab.add(i)).st_shndx != SHN_UNDEF && self.named(i, name)).then_some(())) }.is_some()
    }

    /// Whether symbol `i`'s name is `name`.
    ///
    /// # Safety
    /// `i` indexes the module's symbol table (it came from its hash chains).
    unsafe fn named(&self, i: usize, name: &[u8]) -> bool {
        // SAFETY: the caller's contract; st_name is an offset into the string table,
        // checked against its size before the name is read.
        unsafe {
            let off = (*self.symtab.add(i)).st_name as usize;
            if off + name.len() >= self.strsz {
                return false;
            }
            let stored = std::slice::from_raw_parts(self.strtab.add(off), name.len() + 1);
            stored[..name.len()] == *name && stored[name.len()] == 0
        }
    }

    /// The first `Some` that `pick` gives for a symbol in `name`'s hash chain.
    ///
    /// # Safety
    /// As `lookup`; `pick` is given indices into the module's symbol table.
    #[inline(always)]
    unsafe fn first_in_chain<T>(&self, name: &[u8], mut pick: impl FnMut(usize) -> Option<T>) -> Option<T> {
        let h = gnu_hash(name);
        // SAFETY (this block): the GNU hash table's layout — four u32 words (buckets,
        // first hashed symbol, bloom words, bloom shift), the 64-bit bloom filter, the
        // buckets, then one chain word per hashed symbol, the last of a chain odd.
        unsafe {
            let nbuckets = *self.gnu_hash;
            let symoffset = *self.gnu_hash.add(1);
            let bloom_words = *self.gnu_hash.add(2) as usize;
            if nbuckets == 0 {
                return None;
            }
            if !bloom_admits(std::slice::from_raw_parts(self.gnu_hash.add(4) as *const u64, bloom_words), *self.gnu_hash.add(3), h) {
                return None;
            }
            let buckets = self.gnu_hash.add(4 + 2 * bloom_words);
            let chains = buckets.add(nbuckets as usize);
            let mut i = *buckets.add((h % nbuckets) as usize);
            if i < symoffset {
                return None;
            }
            loop {
                let chain = *chains.add((i - symoffset) as usize);
                if (chain | 1) == (h | 1) {
                    if let Some(v) = pick(i as usize) {
                        return Some(v);
                    }
                }
                if chain & 1 == 1 {
                    return None;
                }
                i += 1;
            }
        }
    }

    /// Symbol `i` when it is `name`'s default-version definition.
    ///
    /// # Safety
    /// `i` indexes the module's symbol table (it came from its hash chains).
    unsafe fn definition(&self, i: usize, name: &[u8]) -> Option<usize> {
        // SAFETY: the caller's contract.
        unsafe {
            let sym = &*self.symtab.add(i);
            let kind = sym.st_info & 0xf;
            if sym.st_shndx == SHN_UNDEF || sym.st_value == 0 || !(kind == STT_FUNC || kind == STT_OBJECT) || !self.named(i, name) {
                return None;
            }
            // Version index 0 is local, 0x8000 marks a hidden (non-default) version.
            if !self.versym.is_null() {
                let v = *self.versym.add(i);
                if v == 0 || v & 0x8000 != 0 {
                    return None;
                }
            }
            Some(self.base + sym.st_value as usize)
        }
    }
}

/// How a module's slot is bound to a symbol by the loader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// `R_X86_64_JUMP_SLOT`: a PLT call's target (filled at the first call under lazy binding).
    Plt,
    /// `R_X86_64_GLOB_DAT` or `R_X86_64_64` with no addend: the symbol's address as data
    /// (`-fno-plt` calls, function pointers).
    Data,
}

/// Calls `visit(slot, name, kind)` for each slot of the module loaded at `base` (dynamic
/// section at `dynamic`) that the loader fills with the address of the symbol `name`.
///
/// # Safety
/// `dynamic` is the mapped, DT_NULL-terminated dynamic section of a module loaded at
/// `base` whose tables are mapped (every module the loader lists, but the vDSO).
pub unsafe fn symbol_slots(base: usize, dynamic: usize, mut visit: impl FnMut(usize, &[u8], SlotKind)) {
    let at = |p: u64| relocated(base, p);
    let (mut symtab, mut strtab, mut strsz) = (0usize, 0usize, 0usize);
    let (mut jmprel, mut pltrelsz, mut pltrel) = (0usize, 0usize, 0i64);
    let (mut rela, mut relasz) = (0usize, 0usize);
    // SAFETY: the caller's contract.
    unsafe {
        each_entry(dynamic, |tag, value| match tag {
            DT_SYMTAB => symtab = at(value),
            DT_STRTAB => strtab = at(value),
            DT_STRSZ => strsz = value as usize,
            DT_JMPREL => jmprel = at(value),
            DT_PLTRELSZ => pltrelsz = value as usize,
            DT_PLTREL => pltrel = value as i64,
            DT_RELA => rela = at(value),
            DT_RELASZ => relasz = value as usize,
            _ => {}
        })
    };
    if symtab == 0 || strtab == 0 || strsz == 0 {
        return;
    }
    let mut each = |table: usize, size: usize| {
        if table == 0 {
            return;
        }
        for k in 0..size / std::mem::size_of::<Rela>() {
            // SAFETY: the module's relocation table, `size` bytes of Elf64_Rela.
            let r = unsafe { &*(table as *const Rela).add(k) };
            let (kind, sym) = ((r.info & 0xffff_ffff) as u32, (r.info >> 32) as usize);
            let kind = match kind {
                R_X86_64_JUMP_SLOT => SlotKind::Plt,
                R_X86_64_GLOB_DAT => SlotKind::Data,
                R_X86_64_64 if r.addend == 0 => SlotKind::Data,
                _ => continue,
            };
            if sym == 0 {
                continue;
            }
            // SAFETY: a symbol index from the module's own relocations; its name is an
            // offset into the string table, bounded by its size below.
            let name = unsafe {
                let off = (*(symtab as *const libc::Elf64_Sym).add(sym)).st_name as usize;
                if off >= strsz {
                    continue;
                }
                let start = (strtab + off) as *const u8;
                let len = (0..strsz - off).find(|&i| *start.add(i) == 0).unwrap_or(0);
                std::slice::from_raw_parts(start, len)
            };
            if !name.is_empty() {
                visit(base + r.offset as usize, name, kind);
            }
        }
    };
    if pltrel == DT_RELA {
        each(jmprel, pltrelsz);
    }
    each(rela, relasz);
}

/// Calls `f(tag, value)` for each entry of the dynamic section at `dynamic`, up to
/// its DT_NULL.
///
/// # Safety
/// `dynamic` is a mapped, DT_NULL-terminated dynamic section.
unsafe fn each_entry(dynamic: usize, mut f: impl FnMut(i64, u64)) {
    let mut d = dynamic as *const Dyn;
    loop {
        // SAFETY: within the section, which ends at DT_NULL (caller's contract).
        let entry = unsafe { &*d };
        if entry.tag == DT_NULL {
            return;
        }
        f(entry.tag, entry.value);
        // SAFETY: the next entry; the last one read is DT_NULL.
        d = unsafe { d.add(1) };
    }
}

/// An address from a dynamic entry of the module loaded at `base`: glibc adds the load
/// bias in place, except where the section is read-only (the vDSO), so a value below
/// `base` is taken as not yet relocated.
fn relocated(base: usize, p: u64) -> usize {
    if (p as usize) < base {
        base + p as usize
    } else {
        p as usize
    }
}

/// An `Elf64_Rela` entry.
#[repr(C)]
struct Rela {
    offset: u64,
    info: u64,
    addend: i64,
}

const DT_PLTRELSZ: i64 = 2;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_PLTREL: i64 = 20;
const DT_JMPREL: i64 = 23;
const R_X86_64_64: u32 = 1;
const R_X86_64_GLOB_DAT: u32 = 6;
const R_X86_64_JUMP_SLOT: u32 = 7;

/// An `Elf64_Dyn` entry.
#[repr(C)]
struct Dyn {
    tag: i64,
    value: u64,
}

const DT_NULL: i64 = 0;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_STRSZ: i64 = 10;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const DT_VERSYM: i64 = 0x6fff_fff0;
const SHN_UNDEF: u16 = 0;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;

/// Whether the ELF file `file` (64-bit, little-endian) has a section named `name`: its
/// header, its section headers and their names read with `pread`, nothing mapped (an
/// `munmap` in a process with two threads costs each core a TLB flush). `None` when
/// the file is not such an ELF file or cannot be read.
pub fn has_section(file: &std::fs::File, name: &[u8]) -> Option<bool> {
    use std::os::unix::fs::FileExt;
    /// More sections than any linker writes for a program: past it, not a real file.
    const MAX_SECTIONS: usize = 1 << 16;
    const MAX_NAMES: u64 = 1 << 20;
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as usize;
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default()) as usize;
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let mut header = [0u8; 64];
    file.read_exact_at(&mut header, 0).ok()?;
    // `\x7fELF`, 64-bit, little-endian.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let (shoff, shentsize, shnum, shstrndx) = (u64_at(&header, 0x28), u16_at(&header, 0x3a), u16_at(&header, 0x3c), u16_at(&header, 0x3e));
    if shentsize < 64 || shnum == 0 || shnum > MAX_SECTIONS || shstrndx >= shnum {
        return None;
    }
    let mut table = vec![0u8; shentsize * shnum];
    file.read_exact_at(&mut table, shoff).ok()?;
    let names_header = &table[shstrndx * shentsize..];
    let (names_at, names_len) = (u64_at(names_header, 0x18), u64_at(names_header, 0x20));
    if names_len > MAX_NAMES {
        return None;
    }
    let mut names = vec![0u8; names_len as usize];
    file.read_exact_at(&mut names, names_at).ok()?;
    let named = |at: usize| names.get(at..).and_then(|rest| rest.split(|&b| b == 0).next()) == Some(name);
    Some(table.chunks_exact(shentsize).any(|section| named(u32_at(section, 0))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The section names read with `pread` are those the `object` crate reads from the
    /// mapped file, for real programs and libraries of this machine.
    #[test]
    fn sections_are_found_as_the_object_crate_finds_them() {
        use object::{Object, ObjectSection};
        let files = ["/proc/self/exe", "/bin/sh", "/usr/bin/env", "/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libgcc_s.so.1"];
        let mut checked = 0;
        for path in files {
            let Ok(file) = std::fs::File::open(path) else { continue };
            // SAFETY: a read-only private mapping of a file no one writes during the test.
            let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
            let obj = object::File::parse(&*map).unwrap();
            for name in [".text", ".go.buildinfo", ".gnu_debuglink", ".eh_frame", ".debug_info", ".tex"] {
                let want = obj.sections().any(|s| s.name() == Ok(name));
                assert_eq!(has_section(&file, name.as_bytes()), Some(want), "{path} {name}");
                checked += 1;
            }
        }
        assert!(checked >= 12, "too few files of this machine were read");
        let text = std::env::temp_dir().join(format!("lt-not-elf-{}", std::process::id()));
        std::fs::write(&text, b"#!/bin/sh\necho not an ELF file, long enough to fill a header ............................\n").unwrap();
        assert_eq!(has_section(&std::fs::File::open(&text).unwrap(), b".text"), None);
        let _ = std::fs::remove_file(&text);
    }

    #[test]
    fn the_bloom_filter_admits_the_names_it_was_built_with() {
        // Built as a linker builds it: both bits of each name's hash set.
        let (shift, names) = (6u32, [&b"malloc"[..], b"free", b"dlsym", b"leaktrace_active"]);
        let mut bloom = [0u64; 4];
        for n in names {
            let h = gnu_hash(n);
            bloom[(h / 64) as usize % 4] |= 1 << (h % 64) | 1 << ((h >> shift) % 64);
        }
        assert!(names.iter().all(|n| bloom_admits(&bloom, shift, gnu_hash(n))));
        // Most other names are turned away (a filter may admit a few by chance).
        let others = (0..1000).filter(|i| bloom_admits(&bloom, shift, gnu_hash(format!("other_{i}").as_bytes()))).count();
        assert!(others < 100, "{others} of 1000 admitted");
        assert!(bloom_admits(&[], shift, gnu_hash(b"anything")));
        assert!(bloom_admits(&[u64::MAX], 40, gnu_hash(b"anything")));
    }

    #[test]
    fn gnu_hash_matches_the_published_values() {
        assert_eq!(gnu_hash(b""), 0x0000_1505);
        assert_eq!(gnu_hash(b"printf"), 0x156b_2bb8);
        assert_eq!(gnu_hash(b"exit"), 0x7c96_7e3f);
        assert_eq!(gnu_hash(b"syscall"), 0xbac2_12a0);
    }

    #[test]
    fn finds_what_the_loader_finds() {
        // In the test binary nothing is interposed: the loader's answers are the truth.
        let here = finds_what_the_loader_finds as *const () as usize;
        let names = [c"dlsym", c"dlvsym", c"malloc", c"dl_iterate_phdr", c"_dl_find_object", c"no_such_symbol_anywhere"];
        let found = next_definitions(names, here);
        for (name, got) in names.iter().zip(found) {
            // SAFETY: dlsym with a valid handle and a NUL-terminated name.
            let want = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            assert_eq!(got, want, "{name:?}");
        }
        assert_ne!(found[0], 0);
    }

    #[test]
    fn the_own_module_is_found_once_and_other_modules_each_time() {
        // The test binary is "our own" module here: the one holding `gnu_hash`.
        let here = the_own_module_is_found_once_and_other_modules_each_time as *const () as usize;
        let [first] = next_definitions([c"malloc"], here);
        let own = OWN_HOME.load(std::sync::atomic::Ordering::Acquire);
        assert!(!own.is_null(), "the own module's link_map is kept after a lookup from it");
        assert!(in_own_module(here) && in_own_module(gnu_hash as *const () as usize));
        // From the cache, the same answers as the first walk; and the same link_map as
        // `dladdr1` names for an address of this module.
        assert_eq!(next_definitions([c"malloc"], here), [first]);
        assert_eq!(home_of(here), Some(own as *const LinkMap));
        // SAFETY: dlsym with a valid handle and a NUL-terminated name.
        let libc_malloc = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) } as usize;
        assert!(!in_own_module(libc_malloc), "libc's malloc is not in the test binary");
        // Another module's link_map is looked up, never the own one handed out for it.
        let other = home_of(libc_malloc).expect("libc is a loaded module");
        assert_ne!(other, own as *const LinkMap);
        // SAFETY: a loaded module's link_map: its name is a C string.
        let name = unsafe { CStr::from_ptr((*other).name) };
        assert!(name.to_bytes().windows(7).any(|w| w == b"libc.so"), "{name:?}");
        assert_eq!(OWN_HOME.load(std::sync::atomic::Ordering::Acquire), own);
    }

    #[test]
    fn the_slots_of_a_loaded_module_name_what_they_hold() {
        // The test binary's libc calls `malloc` through a slot of its own (GLOB_DAT in
        // Debian's build, a PLT slot in others), so that an interposed malloc serves
        // strdup; the slot holds the address the loader bound it to.
        let mut libc_module = None;
        for m in crate::os::loader::loaded_modules() {
            if m.path.to_bytes().rsplit(|&b| b == b'/').next().is_some_and(|f| f.starts_with(b"libc.so")) {
                libc_module = Some(m);
            }
        }
        let m = libc_module.expect("libc is loaded");
        assert_ne!(m.dynamic, 0, "libc has a dynamic section");
        let dynamic = m.dynamic;
        let mut seen = Vec::new();
        // SAFETY: the dynamic section of a module the loader lists.
        unsafe {
            symbol_slots(m.base, dynamic, |slot, name, kind| {
                if name == b"malloc" || name == b"free" {
                    seen.push((name.to_vec(), kind, (slot as *const usize).read()));
                }
            })
        };
        // SAFETY: dlsym with a valid handle and a NUL-terminated name.
        let malloc = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) } as usize;
        assert!(seen.iter().any(|(n, k, v)| n == b"malloc" && (*v == malloc || (*k == SlotKind::Plt && *v >= m.lo && *v < m.hi))), "{seen:?}");
    }

    #[test]
    fn the_first_definition_is_own_only_where_dlsym_finds_ours() {
        // The test binary defines none of these (its hooks are not exported in test
        // builds): each is the C library's, or nobody's.
        for name in [c"malloc", c"free", c"pthread_create", c"dlsym", c"leaktrace_no_such_symbol_anywhere"] {
            // SAFETY: dlsym with a valid handle and a NUL-terminated name.
            let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            let [own] = first_definitions_are_own([name]);
            assert_eq!(own, found != 0 && in_own_module(found), "{name:?}");
            assert!(!own, "{name:?}");
        }
    }

    #[test]
    fn a_name_defined_nowhere_is_told_from_one_the_tables_cannot_resolve() {
        // In the test binary nothing is interposed: dlsym's answers are the truth. glibc's
        // `memcpy` is an IFUNC (the tables cannot give its target), `free_sized` exists
        // from glibc 2.39 only; whichever this C library has, the answers must agree.
        let here = a_name_defined_nowhere_is_told_from_one_the_tables_cannot_resolve as *const () as usize;
        let names = [c"malloc", c"memcpy", c"pthread_cond_wait", c"free_sized", c"leaktrace_no_such_symbol_anywhere"];
        let found = next_definitions_found(names, here);
        for (name, got) in names.iter().zip(found) {
            // SAFETY: dlsym with a valid handle and a NUL-terminated name.
            let want = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            match got {
                Found::At(p) => assert_eq!(p, want, "{name:?}"),
                Found::Nowhere => assert_eq!(want, 0, "{name:?} said to be defined nowhere"),
                Found::Unknown => {}
            }
            assert_eq!(defined_nowhere(name), want == 0 && got != Found::Unknown, "{name:?}");
        }
        assert!(matches!(found[0], Found::At(_)));
        assert_eq!(found[4], Found::Nowhere);
        assert!(defined_nowhere(c"leaktrace_no_such_symbol_anywhere"));
        assert!(!defined_nowhere(c"malloc"));
        // An IFUNC is defined: never "nowhere", whatever the lookup makes of it.
        assert!(!defined_nowhere(c"memcpy"));
        assert_ne!(found[1], Found::Nowhere);
        // Several names in one walk: each answered as alone, whichever come first.
        let names = [c"leaktrace_no_such_symbol_anywhere", c"malloc", c"memcpy", c"__asan_init", c"dl_iterate_phdr"];
        assert_eq!(each_defined_nowhere(names), names.map(defined_nowhere));
        assert_eq!(each_defined_nowhere(names), [true, false, false, true, false]);
        let [none, malloc] = crate::os::loader::global_symbols([c"leaktrace_no_such_symbol_anywhere", c"malloc"]);
        assert_eq!(none, None);
        // SAFETY: dlsym with a valid handle and a NUL-terminated name.
        assert_eq!(malloc, Some(unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) } as usize));
    }

    #[test]
    fn a_hidden_version_is_not_the_default() {
        // glibc keeps the old `pthread_cond_wait@GLIBC_2.2.5` beside the default
        // `@@GLIBC_2.3.2`: the lookup gives the default, as plain dlsym does.
        let here = a_hidden_version_is_not_the_default as *const () as usize;
        let [found] = next_definitions([c"pthread_cond_wait"], here);
        // SAFETY: dlvsym with a valid handle and NUL-terminated strings.
        let old = unsafe { libc::dlvsym(libc::RTLD_DEFAULT, c"pthread_cond_wait".as_ptr(), c"GLIBC_2.2.5".as_ptr()) } as usize;
        // SAFETY: as above.
        let default = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"pthread_cond_wait".as_ptr()) } as usize;
        assert_eq!(found, default);
        assert_ne!(old, 0);
        assert_ne!(old, default);
    }
}
