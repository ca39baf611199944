//! Off the hot path: raw return addresses -> (module, offset) -> function, file, line.
//!
//! An address means a module only while that module is mapped. Stacks are tagged with
//! the dlclose epoch they were captured in, and just before each `dlclose` the list of
//! loaded modules is kept for the epoch that is ending (one `dl_iterate_phdr`, nothing
//! per stack), so a stack from an earlier epoch is resolved against the modules of its
//! own epoch, and one from the current epoch against the live loader. Names are then
//! read from the module *file* (DWARF via addr2line, else the symbol table), which
//! still works after the module was unloaded.
use std::borrow::Cow;
use std::sync::Arc;

use crate::hotpath::{stacks, unwind};
use crate::util::FxMap;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    /// Shared with every frame of a report that names the module.
    pub path: Arc<str>,
    pub base: u64,
    pub start: u64,
    pub end: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub ip: u64,
    /// Index into `Symbolizer::modules` and offset from the module's load bias.
    pub module: Option<(u32, u64)>,
    /// A Python frame word (`hotpath::python`): no address, named by `report::python`.
    pub python: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SymFrame {
    pub function: Option<Arc<str>>,
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
    /// Inlined into the next frame of the same address.
    pub inlined: bool,
}

#[derive(Default)]
pub struct Symbolizer {
    exe_path: String,
    modules: Vec<Module>,
    module_ids: FxMap<(String, u64, u64), u32>,
    /// Module of an address in the epoch `ip_modules_epoch` (the current one).
    ip_modules: FxMap<u64, Option<(u32, u64)>>,
    ip_modules_epoch: u32,
    /// For each ended epoch, the modules loaded when it ended: (start, end, module),
    /// sorted by start.
    ended_epochs: FxMap<u32, Vec<(u64, u64, u32)>>,
    files: FxMap<u32, Option<ModuleFile>>,
    symbols: FxMap<(u32, u64), Vec<SymFrame>>,
    /// Python frames named so far.
    pub python: super::python::PythonNames,
    /// Data symbols found ahead for one report's holders (`prefetch_data_symbols`),
    /// by address; emptied by `forget_data_symbols`.
    data_symbols: FxMap<u64, DataSymbol>,
}

type Reader = gimli::EndianSlice<'static, gimli::RunTimeEndian>;

/// Symbols read between two releases of a module file's pages (~0.8 MB of `.symtab`).
const RELEASE_EVERY_SYMBOLS: usize = 1 << 15;

/// A module file, mapped for the rest of the process (the symbolizer keeps every module
/// it met; unloaded ones are still named from their files): its DWARF, if any, and its
/// ELF symbol tables, whose names are decoded only for the symbols a report asks for.
/// addr2line's `Loader` decodes every symbol name when it opens a file: libtorch_cpu has
/// 546k symbols and 78 MB of names, ~120 ms of each forked worker's final report.
struct ModuleFile {
    file: object::File<'static, FileBytes>,
    dwarf: Option<Debug>,
    map: &'static memmap2::Mmap,
    /// `dwarf` was let go (`forget_dwarf`): read again when a batch needs it.
    dwarf_forgotten: bool,
}

/// A module's DWARF: one addr2line context for the whole file, or, for a large file,
/// a unit at a time (`dwarf_units`): the unit of the batch's last address open until
/// the batch ends.
enum Debug {
    Whole(addr2line::Context<Reader>),
    ByUnit {
        /// Boxed: the sections' readers are ~600 bytes, the whole-file variant ~60.
        sections: Box<gimli::DwarfSections<Reader>>,
        endian: gimli::RunTimeEndian,
        units: super::dwarf_units::UnitIndex,
        open: std::cell::RefCell<Option<super::dwarf_units::OneUnit>>,
        /// The whole file's context, made the first time a unit alone cannot answer.
        whole: std::cell::OnceCell<Option<addr2line::Context<Reader>>>,
    },
}

/// A function symbol: `start`, `end` (`start` when its size is unknown), its index and
/// table (`.dynsym` or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SymbolEntry {
    start: u64,
    end: u64,
    index: u32,
    dynamic: bool,
}

impl SymbolEntry {
    /// Of symbols at one address, the lowest rank names it: one with a size, then one
    /// from `.symtab`, then the lower index (so the choice never depends on order).
    fn rank(&self) -> (bool, bool, u32) {
        (self.end == self.start, self.dynamic, self.index)
    }
}

/// For each of `probes` (ascending), the symbol that holds it: the one with the greatest
/// start at or below it; a symbol of known size must also cover it, one of unknown
/// size (some assembly routines) is taken as reaching up to the next symbol.
///
/// One pass over the symbols, in any order, instead of sorting them into an index: a
/// report asks for a few hundred addresses in a module of half a million symbols, and
/// each forked worker would otherwise sort libtorch_cpu's anew (~40 ms). Each symbol
/// is kept only if it is the highest so far to start in its gap between two probes;
/// a probe whose gap holds none takes the previous probe's symbol.
fn nearest_symbols(probes: &[u64], symbols: impl Iterator<Item = SymbolEntry>) -> Vec<Option<SymbolEntry>> {
    // gap[k]: the best symbol starting in (probes[k - 1], probes[k]].
    let mut gap: Vec<Option<SymbolEntry>> = vec![None; probes.len()];
    let gaps = ProbeBuckets::new(probes);
    for sym in symbols {
        let k = gaps.count_below(sym.start);
        let Some(slot) = gap.get_mut(k) else { continue };
        let better = match slot {
            None => true,
            Some(cur) => (sym.start, std::cmp::Reverse(sym.rank())) > (cur.start, std::cmp::Reverse(cur.rank())),
        };
        if better {
            *slot = Some(sym);
        }
    }
    let mut best: Option<SymbolEntry> = None;
    probes
        .iter()
        .zip(gap)
        .map(|(&probe, in_gap)| {
            if in_gap.is_some() {
                best = in_gap;
            }
            best.filter(|e| e.end == e.start || probe < e.end)
        })
        .collect()
}

/// Answers `probes.partition_point(|&p| p < x)` for ascending `probes` in a step or
/// two: the probes' span is cut into at most 4 buckets per probe, each knowing its first
/// probe. `nearest_symbols` asks once per symbol, half a million times for libtorch_cpu,
/// where a binary search was most of the pass.
struct ProbeBuckets<'a> {
    probes: &'a [u64],
    lo: u64,
    shift: u32,
    /// first[b]: how many probes lie below `lo + (b << shift)`.
    first: Vec<u32>,
}

impl<'a> ProbeBuckets<'a> {
    fn new(probes: &'a [u64]) -> ProbeBuckets<'a> {
        let (lo, hi) = (probes.first().copied().unwrap_or(0), probes.last().copied().unwrap_or(0));
        let most = 4 * probes.len().max(1) as u64;
        let mut shift = 0;
        while (hi - lo) >> shift >= most {
            shift += 1;
        }
        let mut k = 0;
        let first = (0..=(hi - lo) >> shift)
            .map(|b| {
                let at = lo + (b << shift);
                while k < probes.len() && probes[k] < at {
                    k += 1;
                }
                k as u32
            })
            .collect();
        ProbeBuckets { probes, lo, shift, first }
    }

    fn count_below(&self, x: u64) -> usize {
        if x <= self.lo {
            return 0;
        }
        let Some(&first) = self.first.get(((x - self.lo) >> self.shift) as usize) else {
            // Past the last bucket, so past the last probe.
            return self.probes.len();
        };
        let mut k = first as usize;
        while k < self.probes.len() && self.probes[k] < x {
            k += 1;
        }
        k
    }
}

/// A mapped module file's bytes as the `object` crate reads them: those of `&[u8]`,
/// but the end of a name (a section's, a symbol's) is found with a plain loop instead of
/// the `memchr` crate. That crate's first search in a process runs the standard
/// library's CPU feature detection, eight `CPUID` instructions: in a virtual machine
/// each one traps to the hypervisor (7 µs each on the machine measured), ~55 µs of every
/// short process's exit report (`git --version`), where the names are a few dozen bytes.
#[derive(Clone, Copy)]
struct FileBytes(&'static [u8]);

impl object::ReadRef<'static> for FileBytes {
    fn len(self) -> Result<u64, ()> {
        u64::try_from(self.0.len()).map_err(drop)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'static [u8], ()> {
        object::ReadRef::read_bytes_at(self.0, offset, size)
    }

    fn read_bytes_at_until(self, range: std::ops::Range<u64>, delimiter: u8) -> Result<&'static [u8], ()> {
        let start = usize::try_from(range.start).map_err(drop)?;
        let end = usize::try_from(range.end).map_err(drop)?;
        let bytes = self.0.get(start..end).ok_or(())?;
        let len = bytes.iter().position(|&b| b == delimiter).ok_or(())?;
        Ok(&bytes[..len])
    }
}

/// The definitions of an ELF file's `.symtab` and `.dynsym` (`.symtab` first) that
/// `wanted(type, start, size)` keeps, read from the raw table entries with `object`'s
/// own test of a definition: its generic symbols cost several calls per symbol, a third
/// of a pass over libtorch_cpu's 546k.
fn elf_symbols<'e, 'd: 'e, Elf, R, W>(elf: &'e object::read::elf::ElfFile<'d, Elf, R>, wanted: W) -> impl Iterator<Item = SymbolEntry> + use<'e, 'd, Elf, R, W>
where
    Elf: object::read::elf::FileHeader<Endian = object::Endianness>,
    R: object::ReadRef<'d> + 'e,
    W: Fn(object::elf::SymbolType, u64, u64) -> bool + Copy + 'e,
{
    use object::read::elf::Sym;
    let endian = elf.endian();
    [(false, elf.elf_symbol_table()), (true, elf.elf_dynamic_symbol_table())].into_iter().flat_map(move |(dynamic, table)| {
        let strings = table.strings();
        table.symbols().iter().enumerate().filter_map(move |(index, sym)| {
            let start: u64 = sym.st_value(endian).into();
            let size: u64 = sym.st_size(endian).into();
            (wanted(sym.st_type(), start, size) && sym.is_definition(endian, strings)).then(|| SymbolEntry {
                start,
                end: start.saturating_add(size),
                index: index as u32,
                dynamic,
            })
        })
    })
}

/// The functions (`elf_symbols`): the filter of `object`'s generic symbols, a definition
/// of type function or none at a nonzero address.
fn elf_function_symbols<'e, 'd: 'e, Elf: object::read::elf::FileHeader<Endian = object::Endianness>, R: object::ReadRef<'d> + 'e>(
    elf: &'e object::read::elf::ElfFile<'d, Elf, R>,
) -> impl Iterator<Item = SymbolEntry> + use<'e, 'd, Elf, R> {
    elf_symbols(elf, |kind, start, _| start != 0 && matches!(kind, object::elf::STT_FUNC | object::elf::STT_NOTYPE))
}

/// The variables (`elf_symbols`): the filter `object_symbols` asked `object`'s generic
/// symbols for, a definition with a size of kind data, TLS or unknown; a definition is
/// of type object, function or none, so data and untyped symbols are what pass. One
/// pass over libtorch_cpu's 546k symbols names the variables that hold a report's blocks.
fn elf_data_symbols<'e, 'd: 'e, Elf: object::read::elf::FileHeader<Endian = object::Endianness>, R: object::ReadRef<'d> + 'e>(
    elf: &'e object::read::elf::ElfFile<'d, Elf, R>,
) -> impl Iterator<Item = SymbolEntry> + use<'e, 'd, Elf, R> {
    elf_symbols(elf, |kind, _, size| size != 0 && matches!(kind, object::elf::STT_OBJECT | object::elf::STT_NOTYPE))
}

/// Per offset of `offsets` (ascending), the first of `entries` that covers it
/// (`[start, end)`), in the entries' order; one pass, which stops once every offset has
/// one.
fn covering_symbols(offsets: &[u64], entries: impl Iterator<Item = SymbolEntry>) -> Vec<Option<SymbolEntry>> {
    let mut found: Vec<Option<SymbolEntry>> = vec![None; offsets.len()];
    let mut open = offsets.len();
    for e in entries {
        if open == 0 {
            break;
        }
        let first = offsets.partition_point(|&o| o < e.start);
        for k in first..offsets.len() {
            if offsets[k] >= e.end {
                break;
            }
            if found[k].is_none() {
                found[k] = Some(e);
                open -= 1;
            }
        }
    }
    found
}

/// A variable found by `Symbolizer::data_symbol`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataSymbol {
    pub module: Arc<str>,
    pub name: Option<String>,
    /// Of the reference inside the symbol (or from the module's load address).
    pub offset: u64,
}

impl Debug {
    /// The whole file's context, or by unit for a large `.debug_info`
    /// (`dwarf_units::BY_UNIT_MIN_BYTES`). `None` when the DWARF cannot be read.
    /// `release` gives the file's pages back (`ModuleFile::release_pages`), called as the
    /// table of units is made.
    fn new(sections: gimli::DwarfSections<Reader>, endian: gimli::RunTimeEndian, release: impl FnMut()) -> Option<Debug> {
        use gimli::Section;
        let by_unit = sections.debug_info.reader().len() >= super::dwarf_units::BY_UNIT_MIN_BYTES;
        Self::with(sections, endian, by_unit, release)
    }

    fn with(sections: gimli::DwarfSections<Reader>, endian: gimli::RunTimeEndian, by_unit: bool, release: impl FnMut()) -> Option<Debug> {
        if by_unit {
            let units = super::dwarf_units::UnitIndex::build(&sections.borrow(|s| *s), release);
            return Some(Debug::ByUnit { sections: Box::new(sections), endian, units, open: Default::default(), whole: Default::default() });
        }
        addr2line::Context::from_dwarf(sections.borrow(|s| *s)).ok().map(Debug::Whole)
    }
}

/// The DWARF of `file`, as `Debug::new` reads it; `None` without a `.debug_info`.
fn read_dwarf(file: &object::File<'static, FileBytes>, release: impl FnMut()) -> Option<Debug> {
    use object::Object;
    file.section_by_name(".debug_info")?;
    let endian = if file.is_little_endian() { gimli::RunTimeEndian::Little } else { gimli::RunTimeEndian::Big };
    Debug::new(dwarf_sections(file, endian)?, endian, release)
}

/// The DWARF sections of `file` (empty where absent).
fn dwarf_sections(file: &object::File<'static, FileBytes>, endian: gimli::RunTimeEndian) -> Option<gimli::DwarfSections<Reader>> {
    use object::{Object, ObjectSection};
    gimli::DwarfSections::load(|id| -> Result<Reader, gimli::Error> {
        let data: &'static [u8] = match file.section_by_name(id.name()).map(|s| s.uncompressed_data()) {
            Some(Ok(std::borrow::Cow::Borrowed(b))) => b,
            // Compressed debug sections: kept, like the mapping, for the process.
            Some(Ok(std::borrow::Cow::Owned(b))) => Box::leak(b.into_boxed_slice()),
            _ => &[],
        };
        Ok(gimli::EndianSlice::new(data, endian))
    })
    .ok()
}

/// Gives back the pages of a module file's mapping that reads brought in (see
/// `ModuleFile::release_pages`; `allowed`: not under a seccomp filter).
fn release_map(map: &memmap2::Mmap, allowed: bool) {
    if allowed {
        // SAFETY: a private read-only file mapping that nothing wrote: dropping its
        // pages changes no content, the next read faults them in from the file.
        let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
    }
}

/// The frames (innermost inlined first) of `probe` in `ctx`, and whether the lookup
/// met no error (a unit read alone fails where an entry refers into another unit).
fn frames_in(ctx: &addr2line::Context<Reader>, probe: u64) -> (Vec<SymFrame>, bool) {
    let mut out = Vec::new();
    let mut complete = false;
    if let Ok(mut iter) = ctx.find_frames(probe).skip_all_loads() {
        loop {
            match iter.next() {
                Ok(Some(frame)) => {
                    let function = frame.function.as_ref().and_then(|f| f.demangle().ok()).map(|c| Arc::from(c.as_ref()));
                    let (file, line) = match frame.location {
                        Some(loc) => (loc.file.map(Arc::from), loc.line),
                        None => (None, None),
                    };
                    out.push(SymFrame { function, file, line, inlined: true });
                }
                Ok(None) => {
                    complete = true;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    if let Some(last) = out.last_mut() {
        last.inlined = false;
    }
    (out, complete)
}

impl ModuleFile {
    /// For each of `offsets` (ascending, file terms), in one pass over the symbol
    /// tables: the data object (variable) symbol that covers it, its name and start:
    /// the first of `.symtab` (static variables are there only), else of `.dynsym`. A
    /// report names the holders of dozens of groups; one pass each over libc's or git's
    /// tables, their pages given back after each, was ~1.5 ms of a short process's
    /// final report.
    fn object_symbols(&self, offsets: &[u64], allowed: bool) -> Vec<Option<(String, u64)>> {
        debug_assert!(offsets.is_sorted());
        let found = match &self.file {
            object::File::Elf64(elf) => covering_symbols(offsets, self.releasing(allowed, elf_data_symbols(elf))),
            object::File::Elf32(elf) => covering_symbols(offsets, self.releasing(allowed, elf_data_symbols(elf))),
            // Only ELF modules are ever loaded here.
            _ => vec![None; offsets.len()],
        };
        // `None` where the covering symbol's name cannot be read, as a single lookup
        // gives up there.
        found.into_iter().map(|e| e.and_then(|e| Some((self.symbol_name(&e)?, e.start)))).collect()
    }

    fn open(path: &str) -> Option<ModuleFile> {
        let map: &'static memmap2::Mmap = Box::leak(Box::new(crate::hotpath::mapping::map_file(path)?));
        let file = object::File::parse(FileBytes(&map[..])).ok()?;
        let allowed = crate::os::procfs::unfiltered_now();
        let dwarf = read_dwarf(&file, || release_map(map, allowed));
        Some(ModuleFile { dwarf, file, map, dwarf_forgotten: false })
    }

    /// Lets go of what reading the file's DWARF built, until a batch needs it again
    /// (`recall_dwarf`): addr2line's context holds every unit's abbreviations from the
    /// start, then the lines and functions of each unit a lookup went into. Between
    /// reports that was ~10 MB of our heap for Python's own library alone (a pyenv
    /// build, with DWARF) in `import torch`, at the program's peak; names already found
    /// stay in `Symbolizer::symbols`. A file read a unit at a time keeps its table of
    /// units (small, and slow to make again) and lets go of its whole-file context.
    fn forget_dwarf(&mut self) {
        match &mut self.dwarf {
            Some(Debug::Whole(_)) => {
                self.dwarf = None;
                self.dwarf_forgotten = true;
            }
            Some(Debug::ByUnit { open, whole, .. }) => {
                *open.get_mut() = None;
                whole.take();
            }
            None => {}
        }
    }

    /// Reads the DWARF again if `forget_dwarf` let it go.
    fn recall_dwarf(&mut self) {
        if std::mem::take(&mut self.dwarf_forgotten) {
            let (map, allowed) = (self.map, crate::os::procfs::unfiltered_now());
            self.dwarf = read_dwarf(&self.file, || release_map(map, allowed));
        }
    }

    /// Gives back the file's pages that a lookup brought in: they count in the process's
    /// RSS as long as they stay mapped (libtorch_cpu's symbol tables alone are ~60 MB),
    /// and the next report's lookup finds them in the page cache. Not under a seccomp
    /// filter, which may answer `madvise` with SIGSYS.
    fn release_pages(&self, allowed: bool) {
        release_map(self.map, allowed);
    }

    fn frames(&self, probe: u64) -> Vec<SymFrame> {
        match &self.dwarf {
            Some(Debug::Whole(ctx)) => frames_in(ctx, probe).0,
            Some(Debug::ByUnit { sections, endian, units, open, whole }) => {
                // An address in no unit's ranges is in no context's either.
                let Some((offset, end)) = units.unit_of(probe) else { return Vec::new() };
                let mut open = open.borrow_mut();
                if open.as_ref().is_none_or(|u| u.offset != offset) {
                    // The last unit goes before the next is read.
                    *open = None;
                    *open = super::dwarf_units::OneUnit::open(sections, offset, end, *endian);
                }
                match open.as_ref().map(|u| frames_in(&u.ctx, probe)) {
                    Some((frames, true)) => frames,
                    // An entry of the unit refers into another unit: the whole file's
                    // context, made once, answers as before.
                    _ => whole
                        .get_or_init(|| addr2line::Context::from_dwarf(sections.borrow(|s| *s)).ok())
                        .as_ref()
                        .map(|c| frames_in(c, probe).0)
                        .unwrap_or_default(),
                }
            }
            None => Vec::new(),
        }
    }

    /// `frames` of each of `probes`, those of one unit read alone together (a module's
    /// static constructors lie together in `.text.startup`, whatever their units: in
    /// address order, their units alternate).
    fn frames_of_all(&self, probes: &[u64]) -> Vec<Vec<SymFrame>> {
        let Some(Debug::ByUnit { units, .. }) = &self.dwarf else { return probes.iter().map(|&p| self.frames(p)).collect() };
        let mut order: Vec<usize> = (0..probes.len()).collect();
        order.sort_by_key(|&i| (units.unit_of(probes[i]).map(|u| u.0), probes[i]));
        let mut out = vec![Vec::new(); probes.len()];
        for i in order {
            out[i] = self.frames(probes[i]);
        }
        out
    }

    /// The end of a batch of lookups: a unit read alone is dropped.
    fn end_batch(&self) {
        if let Some(Debug::ByUnit { open, .. }) = &self.dwarf {
            *open.borrow_mut() = None;
        }
    }

    /// `items` (read from the file's mapping), giving the file's pages back every
    /// `RELEASE_EVERY_SYMBOLS` of them (`allowed`: see `release_pages`): a pass over
    /// libtorch_cpu's symbol table had mapped its 13 MB while the exit scan ran beside it.
    fn releasing<'s, T>(&'s self, allowed: bool, items: impl Iterator<Item = T> + 's) -> impl Iterator<Item = T> + 's {
        items.enumerate().map(move |(i, item)| {
            if i > 0 && i % RELEASE_EVERY_SYMBOLS == 0 {
                self.release_pages(allowed);
            }
            item
        })
    }

    /// The names of the functions that hold `probes` (ascending; addresses in the
    /// file's terms), from `.symtab` and `.dynsym`.
    fn symbol_names(&self, probes: &[u64], allowed: bool) -> Vec<Option<String>> {
        let file = &self.file;
        let found = match file {
            object::File::Elf64(elf) => nearest_symbols(probes, self.releasing(allowed, elf_function_symbols(elf))),
            object::File::Elf32(elf) => nearest_symbols(probes, self.releasing(allowed, elf_function_symbols(elf))),
            // Only ELF modules are ever loaded here.
            _ => vec![None; probes.len()],
        };
        found.into_iter().map(|e| self.symbol_name(&e?)).collect()
    }

    /// The name of a symbol of the raw tables (`elf_symbols`), demangled.
    fn symbol_name(&self, e: &SymbolEntry) -> Option<String> {
        use object::{Object, ObjectSymbol, ObjectSymbolTable, SymbolIndex};
        let table = if e.dynamic { self.file.dynamic_symbol_table()? } else { self.file.symbol_table()? };
        let name = table.symbol_by_index(SymbolIndex(e.index as usize)).ok()?.name().ok()?;
        Some(demangle_symbol(name))
    }
}

/// A symbol table name as people read it: mangled C++ (`_Z…`) and Rust (`_ZN…`, `_R…`)
/// names demangled, every other name as it is. A C function called `f`, `i`, `d` or `Ss`
/// is not a mangled type ("float", "int", "double", "std::string").
pub fn demangle_symbol(name: &str) -> String {
    if name.starts_with("_Z") || name.starts_with("_R") {
        addr2line::demangle_auto(Cow::Borrowed(name), None).into_owned()
    } else {
        name.to_string()
    }
}

/// The absolute path of the file mapped at `start` (`/proc/self/maps`), for a module the
/// loader names by a relative path: `dlopen("./libx.so")` and `ctypes.CDLL("./libx.so")`
/// keep the name as given, relative to the directory of that call, which the program may
/// have left since. Such a module's frames had no names (its file is opened by absolute
/// path only). `None` where the line is not found or its file was deleted.
fn mapped_path_at(start: u64) -> Option<String> {
    let maps = crate::os::anchor::read_proc_string("self/maps").ok()?;
    path_at_in_maps(&maps, start)
}

/// `mapped_path_at`'s search of a `/proc/self/maps` text.
fn path_at_in_maps(maps: &str, start: u64) -> Option<String> {
    maps.lines().find_map(|line| {
        let (lo, _) = line.split_once('-')?;
        if u64::from_str_radix(lo, 16).ok()? != start {
            return None;
        }
        // `lo-hi perms offset dev inode   path`: the path is the rest after the inode.
        let mut rest = line;
        for _ in 0..5 {
            rest = rest.trim_start().split_once(' ')?.1;
        }
        let path = rest.trim_start();
        (path.starts_with('/') && !path.ends_with(" (deleted)")).then(|| path.to_string())
    })
}

impl Symbolizer {
    pub fn new(exe_path: String) -> Symbolizer {
        Symbolizer { exe_path, ..Default::default() }
    }

    pub fn module(&self, idx: u32) -> Option<&Module> {
        self.modules.get(idx as usize)
    }

    fn module_index(&mut self, path: String, base: u64, start: u64, end: u64) -> u32 {
        let path = if path.is_empty() {
            self.exe_path.clone()
        } else if !path.starts_with('/') {
            mapped_path_at(start).unwrap_or(path)
        } else {
            path
        };
        let key = (path.clone(), base, start);
        let next = self.modules.len() as u32;
        let idx = *self.module_ids.entry(key).or_insert(next);
        if idx == next {
            self.modules.push(Module { path: path.into(), base, start, end });
        }
        idx
    }

    fn module_for_ip(&mut self, ip: u64) -> Option<(u32, u64)> {
        let epoch = unwind::epoch();
        if epoch != self.ip_modules_epoch {
            // A dlclose since: the same address may now mean another module.
            self.ip_modules.clear();
            self.ip_modules_epoch = epoch;
        }
        if let Some(m) = self.ip_modules.get(&ip) {
            return *m;
        }
        let found = unwind::module_of(ip).map(|m| (self.module_index(m.path, m.base, m.start, m.end), ip.wrapping_sub(m.base)));
        self.ip_modules.insert(ip, found);
        found
    }

    /// Call just before a `dlclose`: keeps the loaded modules for the epoch it ends.
    /// Several threads may call it in one epoch; their lists are merged.
    pub fn pin_modules(&mut self) {
        let epoch = unwind::epoch();
        let pinned: Vec<(u64, u64, u32)> = crate::os::loader::loaded_modules()
            .into_iter()
            .map(|m| {
                let path = m.path.to_string_lossy().into_owned();
                let (base, lo, hi) = (m.base as u64, m.lo as u64, m.hi as u64);
                (lo, hi, self.module_index(path, base, lo, hi))
            })
            .collect();
        let list = self.ended_epochs.entry(epoch).or_default();
        list.extend(pinned);
        list.sort_unstable();
        list.dedup();
    }

    /// A return address with its module, as a stack's frames are.
    pub fn raw_frame(&mut self, ip: u64) -> RawFrame {
        RawFrame { ip, module: self.module_for_ip(ip), python: None }
    }

    /// The global or static variable that holds `addr` (a word of a module's data),
    /// from the module file's `.symtab` or `.dynsym`: the object symbol whose extent
    /// covers it, and the offset inside it. The module alone (with the offset from its
    /// load address) where no symbol covers it (a stripped module, the allocator's
    /// arrays).
    pub fn data_symbol(&mut self, addr: u64) -> Option<DataSymbol> {
        if let Some(d) = self.data_symbols.get(&addr) {
            return Some(d.clone());
        }
        self.find_data_symbols(&[addr]).pop().map(|(_, d)| d)
    }

    /// Finds the data symbols of `addrs` at once (`data_symbol` then answers them from
    /// memory).
    pub fn prefetch_data_symbols(&mut self, addrs: &[u64]) {
        let wanted: Vec<u64> = addrs.iter().copied().filter(|a| !self.data_symbols.contains_key(a)).collect();
        for (addr, d) in self.find_data_symbols(&wanted) {
            self.data_symbols.insert(addr, d);
        }
    }

    /// `data_symbol` of each of `addrs` in a module (the others are left out): one pass
    /// over each module's symbol tables for all its addresses, and one look at whether
    /// `madvise` is allowed.
    fn find_data_symbols(&mut self, addrs: &[u64]) -> Vec<(u64, DataSymbol)> {
        let mut by_module: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = Default::default();
        for &addr in addrs {
            let Some(m) = unwind::module_of(addr) else { continue };
            let idx = self.module_index(m.path, m.base, m.start, m.end);
            by_module.entry(idx).or_default().push((addr.wrapping_sub(self.modules[idx as usize].base), addr));
        }
        if by_module.is_empty() {
            return Vec::new();
        }
        let allowed = crate::os::procfs::unfiltered_now();
        let mut out = Vec::with_capacity(addrs.len());
        for (idx, mut wanted) in by_module {
            wanted.sort_unstable();
            wanted.dedup();
            let offsets: Vec<u64> = wanted.iter().map(|&(o, _)| o).collect();
            let found = self.file(idx).map(|f| {
                let found = f.object_symbols(&offsets, allowed);
                f.release_pages(allowed);
                found
            });
            let module = self.modules[idx as usize].path.clone();
            for (k, &(offset, addr)) in wanted.iter().enumerate() {
                let d = match found.as_ref().and_then(|f| f[k].clone()) {
                    Some((name, start)) => DataSymbol { module: module.clone(), name: Some(name), offset: offset - start },
                    None => DataSymbol { module: module.clone(), name: None, offset },
                };
                out.push((addr, d));
            }
        }
        out
    }

    /// Drops what `prefetch_data_symbols` found (the modules may change before the next
    /// report).
    pub fn forget_data_symbols(&mut self) {
        self.data_symbols = Default::default();
    }

    /// A captured stack's frames with their modules (innermost first).
    pub fn raw_stack(&mut self, id: u32) -> Vec<RawFrame> {
        let (frames, epoch) = stacks::frames_and_epoch(id).unwrap_or_default();
        if frames.first() == Some(&crate::hotpath::python::PY_STACK) {
            // The native stack, then the Python frames (placed by `report::python::merge`).
            let mut out = frames.get(1).map_or_else(Vec::new, |&native| self.raw_stack(native as u32));
            let words = crate::hotpath::python::python_words(&frames).unwrap_or_default();
            out.extend(words.into_iter().map(|w| RawFrame { ip: 0, module: None, python: Some(w) }));
            return out;
        }
        if epoch == unwind::epoch() {
            return frames.iter().map(|&ip| RawFrame { ip, module: self.module_for_ip(ip), python: None }).collect();
        }
        let ended = self.ended_epochs.get(&epoch).map(Vec::as_slice).unwrap_or(&[]);
        frames
            .iter()
            .map(|&ip| {
                let i = ended.partition_point(|m| m.0 <= ip);
                let module = i.checked_sub(1).map(|i| ended[i]).filter(|m| ip < m.1).map(|(_, _, idx)| (idx, ip.wrapping_sub(self.modules[idx as usize].base)));
                RawFrame { ip, module, python: None }
            })
            .collect()
    }

    fn file(&mut self, module: u32) -> Option<&mut ModuleFile> {
        if !self.files.contains_key(&module) {
            let file = self.modules.get(module as usize).filter(|m| m.path.starts_with('/')).and_then(|m| ModuleFile::open(&m.path));
            self.files.insert(module, file);
        }
        self.files.get_mut(&module).and_then(|f| f.as_mut())
    }

    /// Symbolizes every `(module, offset)` of `wanted` not done before, module by
    /// module: DWARF first, then one pass over the symbol tables for the addresses
    /// DWARF names no function for.
    pub fn symbolize_all(&mut self, wanted: impl IntoIterator<Item = (u32, u64)>) {
        let mut by_module: FxMap<u32, Vec<u64>> = FxMap::default();
        for (module, offset) in wanted {
            if !self.symbols.contains_key(&(module, offset)) {
                by_module.entry(module).or_default().push(offset);
            }
        }
        let allowed = !by_module.is_empty() && crate::os::procfs::unfiltered_now();
        for (module, mut offsets) in by_module {
            offsets.sort_unstable();
            offsets.dedup();
            let resolved: Vec<Vec<SymFrame>> = match self.file(module) {
                Some(file) => {
                    file.recall_dwarf();
                    // A return address points after the call; look up the call instruction.
                    let calls: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
                    let mut frames = file.frames_of_all(&calls);
                    let unnamed: Vec<usize> = (0..frames.len()).filter(|&i| frames[i].iter().all(|f| f.function.is_none())).collect();
                    let probes: Vec<u64> = unnamed.iter().map(|&i| calls[i]).collect();
                    for (i, name) in unnamed.into_iter().zip(file.symbol_names(&probes, allowed)) {
                        let Some(name) = name else { continue };
                        match frames[i].last_mut() {
                            Some(last) => last.function = Some(name.into()),
                            None => frames[i].push(SymFrame { function: Some(name.into()), ..Default::default() }),
                        }
                    }
                    file.end_batch();
                    file.release_pages(allowed);
                    frames
                }
                None => vec![Vec::new(); offsets.len()],
            };
            for (offset, frames) in offsets.into_iter().zip(resolved) {
                self.symbols.insert((module, offset), frames);
            }
        }
    }

    /// The end of a report: what reading the modules' DWARF built is let go
    /// (`ModuleFile::forget_dwarf`); the names found stay.
    pub fn forget_dwarf(&mut self) {
        for file in self.files.values_mut().flatten() {
            file.forget_dwarf();
        }
    }

    /// The module's path and the frames of `(module, offset)` (function/file/line,
    /// innermost inlined frame first): those `symbolize_all` found, else symbolized now.
    /// Ask for many at once with `symbolize_all` first: alone, an address a module's
    /// DWARF does not name costs a pass over its symbol tables. A report's stacks ask
    /// for ~100k frames after one batch of their few thousand addresses: two lookups
    /// each (the check is apart from the borrowed answer, for the borrow checker),
    /// nothing copied.
    pub fn named(&mut self, module: u32, offset: u64) -> (Option<&Arc<str>>, &[SymFrame]) {
        if !self.symbols.contains_key(&(module, offset)) {
            self.symbolize_all([(module, offset)]);
        }
        (self.modules.get(module as usize).map(|m| &m.path), self.symbols.get(&(module, offset)).map_or(&[][..], Vec::as_slice))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_relatively_named_module_is_found_by_its_mapping() {
        let maps = "7f00-7f10 r--p 00000000 fe:00 42                         /opt/my lib/libx.so\n\
                    7f10-7f20 r-xp 00001000 fe:00 42                         /opt/my lib/libx.so\n\
                    7f30-7f40 r--p 00000000 fe:00 43                         /tmp/gone.so (deleted)\n\
                    7f50-7f60 rw-p 00000000 00:00 0 \n";
        assert_eq!(super::path_at_in_maps(maps, 0x7f00).as_deref(), Some("/opt/my lib/libx.so"));
        assert_eq!(super::path_at_in_maps(maps, 0x7f10).as_deref(), Some("/opt/my lib/libx.so"));
        assert_eq!(super::path_at_in_maps(maps, 0x7f30), None);
        assert_eq!(super::path_at_in_maps(maps, 0x7f50), None);
        assert_eq!(super::path_at_in_maps(maps, 0x7f08), None);
    }
    use super::*;

    /// Variables named for many holders at once (`prefetch_data_symbols`) are those
    /// named one at a time: a static of the test binary (`.symtab`, its start and its
    /// middle), libc's `stdout` and `environ` (`.dynsym`, inside one too), and a word
    /// past the static's end.
    #[test]
    fn data_symbols_found_together_are_those_found_one_at_a_time() {
        static HOLDER_TABLE: [std::sync::atomic::AtomicU64; 64] = [const { std::sync::atomic::AtomicU64::new(0) }; 64];
        assert!(crate::hotpath::unwind::init());
        let table = HOLDER_TABLE.as_ptr() as u64;
        // SAFETY: dlsym with a valid handle and NUL-terminated names.
        let (stdout, environ) =
            unsafe { (libc::dlsym(libc::RTLD_DEFAULT, c"stdout".as_ptr()) as u64, libc::dlsym(libc::RTLD_DEFAULT, c"environ".as_ptr()) as u64) };
        assert!(stdout != 0 && environ != 0);
        let addrs = [table + 8 * 40, stdout, table, environ, stdout + 4, table + 8 * 64, table + 8 * 40];
        let exe = std::env::current_exe().unwrap().to_string_lossy().into_owned();
        let mut single = Symbolizer::new(exe.clone());
        let one: Vec<_> = addrs.iter().map(|&a| single.data_symbol(a)).collect();
        let mut batch = Symbolizer::new(exe);
        batch.prefetch_data_symbols(&addrs);
        let together: Vec<_> = addrs.iter().map(|&a| batch.data_symbol(a)).collect();
        assert_eq!(one, together);
        let named = |d: &Option<DataSymbol>| d.as_ref().and_then(|d| d.name.clone()).unwrap_or_default();
        assert!(named(&together[2]).contains("HOLDER_TABLE"), "{:?}", together[2]);
        assert_eq!(together[0].as_ref().map(|d| d.offset), Some(8 * 40));
        assert_eq!(named(&together[1]), "stdout");
        assert_eq!(together[4].as_ref().map(|d| (named(&together[4]), d.offset)), Some(("stdout".into(), 4)));
        assert!(!named(&together[5]).contains("HOLDER_TABLE"), "{:?}", together[5]);
        batch.forget_data_symbols();
        assert_eq!(addrs.iter().map(|&a| batch.data_symbol(a)).collect::<Vec<_>>(), one);
    }

    /// A file whose DWARF was let go between two reports reads it again for the next
    /// batch and names the same frames; one read a unit at a time keeps its units.
    #[test]
    fn dwarf_let_go_is_read_again_and_names_the_same_frames() {
        use object::{Object, ObjectSymbol};
        let path = std::env::current_exe().unwrap();
        let mut file = ModuleFile::open(path.to_str().unwrap()).expect("the test binary opens");
        let endian = gimli::RunTimeEndian::Little;
        file.dwarf = Debug::with(dwarf_sections(&file.file, endian).unwrap(), endian, false, || {});
        assert!(matches!(file.dwarf, Some(Debug::Whole(_))));
        let mut starts: Vec<u64> = file.file.symbols().filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 16).map(|s| s.address()).collect();
        starts.sort_unstable();
        let probes: Vec<u64> = starts.iter().step_by(starts.len() / 200 + 1).map(|&a| a + 7).collect();
        let before = file.frames_of_all(&probes);
        assert!(before.iter().filter(|f| f.iter().any(|f| f.line.is_some())).count() > probes.len() / 2);
        file.forget_dwarf();
        assert!(file.dwarf.is_none() && file.dwarf_forgotten);
        assert!(file.frames_of_all(&probes).iter().all(Vec::is_empty), "nothing read until recalled");
        file.recall_dwarf();
        assert!(!file.dwarf_forgotten && file.dwarf.is_some());
        assert_eq!(file.frames_of_all(&probes), before);
        file.end_batch();
        file.forget_dwarf();
        file.recall_dwarf();
        assert_eq!(file.frames_of_all(&probes), before, "a second time");

        let sections = dwarf_sections(&file.file, endian).unwrap();
        let mut by_unit = ModuleFile { dwarf: Debug::with(sections, endian, true, || {}), ..ModuleFile::open(path.to_str().unwrap()).unwrap() };
        let wanted = by_unit.frames_of_all(&probes);
        by_unit.forget_dwarf();
        assert!(matches!(by_unit.dwarf, Some(Debug::ByUnit { .. })) && !by_unit.dwarf_forgotten);
        assert_eq!(by_unit.frames_of_all(&probes), wanted);
    }

    /// A file's DWARF read a unit at a time names what the whole file's context names:
    /// the frames (functions, inlined ones, files and lines) of addresses spread over
    /// the test binary's own functions.
    #[test]
    fn by_unit_frames_are_the_whole_contexts() {
        use object::{Object, ObjectSymbol};
        let path = std::env::current_exe().unwrap();
        let Some(file) = ModuleFile::open(path.to_str().unwrap()) else { panic!("cannot open {}", path.display()) };
        let endian = gimli::RunTimeEndian::Little;
        let load = || dwarf_sections(&file.file, endian).unwrap();
        let whole = ModuleFile { dwarf: Debug::with(load(), endian, false, || {}), ..ModuleFile::open(path.to_str().unwrap()).unwrap() };
        let by_unit = ModuleFile { dwarf: Debug::with(load(), endian, true, || {}), ..ModuleFile::open(path.to_str().unwrap()).unwrap() };
        let Some(Debug::ByUnit { units, .. }) = &by_unit.dwarf else { panic!("not by unit") };
        assert!(units.spans() > 10, "{} spans", units.spans());
        let mut starts: Vec<u64> = file.file.symbols().filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 16).map(|s| s.address()).collect();
        starts.sort_unstable();
        let probes: Vec<u64> = starts.iter().step_by(starts.len() / 400 + 1).flat_map(|&a| [a, a + 7, a + 16]).collect();
        let (mut named, mut inlined) = (0, 0);
        for &p in &probes {
            let (a, b) = (whole.frames(p), by_unit.frames(p));
            assert_eq!(a, b, "probe {p:#x}");
            named += usize::from(a.iter().any(|f| f.function.is_some() && f.line.is_some()));
            inlined += usize::from(a.len() > 1);
        }
        by_unit.end_batch();
        // A batch, grouped by unit, gives each probe its frames in place.
        let wanted: Vec<Vec<SymFrame>> = probes.iter().map(|&p| whole.frames(p)).collect();
        assert!(by_unit.frames_of_all(&probes) == wanted, "a batch by unit differs");
        by_unit.end_batch();
        assert!(named > probes.len() / 2 && inlined > 0, "{named} named, {inlined} with inlined frames, of {}", probes.len());
        // Units alone answered some (the rest refer into other units: the whole file's
        // context answered those).
        let Some(Debug::ByUnit { sections, units, .. }) = &by_unit.dwarf else { panic!() };
        let alone = probes
            .iter()
            .filter(|&&p| {
                let Some((o, e)) = units.unit_of(p) else { return false };
                super::super::dwarf_units::OneUnit::open(sections, o, e, endian).is_some_and(|u| frames_in(&u.ctx, p).1)
            })
            .count();
        assert!(alone > 0, "no unit answered alone");
        eprintln!("{alone} of {} probes answered by their unit alone", probes.len());
    }

    #[test]
    fn only_mangled_names_are_demangled() {
        for c_name in ["f", "i", "d", "Ss", "main", "malloc", "St", "v"] {
            assert_eq!(demangle_symbol(c_name), c_name);
        }
        assert_eq!(demangle_symbol("_Z3fooi"), "foo(int)");
        assert_eq!(demangle_symbol("_ZNSsC1Ev"), "std::string::string()");
        assert!(demangle_symbol("_ZN4core3ptr13drop_in_place17h0123456789abcdefE").starts_with("core::ptr::drop_in_place"));
    }

    fn sym(start: u64, size: u64, index: u32, dynamic: bool) -> SymbolEntry {
        SymbolEntry { start, end: start + size, index, dynamic }
    }

    /// The rule `nearest_symbols` implements, the slow way: sort, then search.
    fn by_index(probes: &[u64], symbols: &[SymbolEntry]) -> Vec<Option<SymbolEntry>> {
        let mut sorted = symbols.to_vec();
        // By address; at one address the preferred symbol last, where the search lands.
        sorted.sort_by_key(|e| (e.start, std::cmp::Reverse(e.rank())));
        probes
            .iter()
            .map(|&p| {
                let i = sorted.partition_point(|e| e.start <= p).checked_sub(1)?;
                Some(sorted[i]).filter(|e| e.end == e.start || p < e.end)
            })
            .collect()
    }

    #[test]
    fn nearest_symbol_by_address_size_and_preference() {
        let symbols = [
            sym(0x100, 0x50, 1, false),
            sym(0x100, 0x50, 9, true), // the same function in .dynsym: .symtab's is named
            sym(0x200, 0, 2, false),   // unknown size: reaches the next symbol
            sym(0x300, 0x10, 3, false),
            sym(0x300, 0, 4, false), // same start, unknown size: the sized one wins
        ];
        let probes = [0x50, 0x100, 0x120, 0x160, 0x200, 0x2ff, 0x305, 0x310, 0x310, 0x5000];
        let got: Vec<Option<u32>> = nearest_symbols(&probes, symbols.iter().copied()).iter().map(|e| e.map(|e| e.index)).collect();
        assert_eq!(got, [None, Some(1), Some(1), None, Some(2), Some(2), Some(3), None, None, None]);
        // Order of the symbols does not matter.
        let reversed: Vec<_> = nearest_symbols(&probes, symbols.iter().rev().copied()).iter().map(|e| e.map(|e| e.index)).collect();
        assert_eq!(got, reversed);
    }

    #[test]
    fn probe_buckets_count_what_a_binary_search_counts() {
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = |n: u64| rng.below(n);
        for round in 0..300 {
            // Spans from a few bytes to most of the address space, with repeats and clusters.
            let span = 1u64 << next(48);
            let mut probes: Vec<u64> = (0..next(50)).map(|_| 0x4000 + next(span)).collect();
            if round % 3 == 0 {
                probes.extend(probes.clone());
            }
            probes.sort_unstable();
            let buckets = ProbeBuckets::new(&probes);
            let ends = [0, 0x3fff, 0x4000, 0x4000 + span, 0x4000 + span + 1, u64::MAX];
            for x in (0..200).map(|_| 0x3ff0 + next(span + 32)).chain(probes.iter().flat_map(|&p| [p - 1, p, p + 1])).chain(ends) {
                assert_eq!(buckets.count_below(x), probes.partition_point(|&p| p < x), "{x:#x} in {probes:x?}");
            }
        }
    }

    /// A file read through `FileBytes` has the sections and symbols, names included,
    /// that it has read as a plain slice (this test binary, with its `.symtab`, and the C
    /// library); a name with no end in its table is an error, as the slice's.
    #[test]
    fn file_bytes_read_what_a_slice_reads() {
        use object::{Object, ObjectSection, ObjectSymbol, ReadRef};
        let mut checked = 0;
        for path in [std::env::current_exe().unwrap().display().to_string(), "/lib/x86_64-linux-gnu/libc.so.6".to_string()] {
            let Ok(data) = std::fs::read(&path) else { continue };
            let data: &'static [u8] = Box::leak(data.into_boxed_slice());
            let plain = object::File::parse(data).unwrap();
            let ours = object::File::parse(FileBytes(data)).unwrap();
            fn sections<R: ReadRef<'static>>(f: &object::File<'static, R>) -> Vec<(Result<String, object::Error>, u64, u64)> {
                f.sections().map(|s| (s.name().map(str::to_owned), s.address(), s.size())).collect()
            }
            let names =
                |syms: &mut dyn Iterator<Item = (Result<&'static str, object::Error>, u64)>| syms.map(|(n, a)| (n.map(str::to_owned), a)).collect::<Vec<_>>();
            assert_eq!(sections(&plain), sections(&ours), "{path}");
            assert_eq!(names(&mut plain.symbols().map(|s| (s.name(), s.address()))), names(&mut ours.symbols().map(|s| (s.name(), s.address()))), "{path}");
            assert_eq!(
                names(&mut plain.dynamic_symbols().map(|s| (s.name(), s.address()))),
                names(&mut ours.dynamic_symbols().map(|s| (s.name(), s.address()))),
                "{path}"
            );
            assert!(plain.symbols().count() + plain.dynamic_symbols().count() > 100, "{path}");
            checked += 1;
        }
        assert!(checked >= 1);
        let bytes: &'static [u8] = b"abc\0def";
        assert_eq!(FileBytes(bytes).read_bytes_at_until(0..7, 0), Ok(&b"abc"[..]));
        assert_eq!(FileBytes(bytes).read_bytes_at_until(4..7, 0), Err(()));
        assert_eq!(FileBytes(bytes).read_bytes_at_until(4..9, 0), Err(()));
        assert_eq!(bytes.read_bytes_at_until(4..7, 0), Err(()));
    }

    /// The raw-table filter of variables keeps what `object_symbols` kept with the
    /// generic API, in the same order, on this test binary's tables and the C library's.
    #[test]
    fn raw_elf_data_symbols_are_the_generic_api_data_symbols() {
        use object::{Object, ObjectSymbol, SymbolKind};
        let mut checked = 0;
        for path in [std::env::current_exe().unwrap().display().to_string(), "/lib/x86_64-linux-gnu/libc.so.6".to_string()] {
            let Ok(data) = std::fs::read(&path) else { continue };
            let file = object::File::parse(&data[..]).unwrap();
            let generic: Vec<SymbolEntry> = [(false, file.symbols()), (true, file.dynamic_symbols())]
                .into_iter()
                .flat_map(|(dynamic, symbols)| {
                    symbols
                        .filter(|s| s.size() != 0 && matches!(s.kind(), SymbolKind::Data | SymbolKind::Tls | SymbolKind::Unknown) && s.is_definition())
                        .map(move |s| SymbolEntry { start: s.address(), end: s.address() + s.size(), index: s.index().0 as u32, dynamic })
                })
                .collect();
            let object::File::Elf64(elf) = &file else { panic!("not ELF64") };
            let raw: Vec<SymbolEntry> = elf_data_symbols(elf).collect();
            assert!(raw.len() > 20, "{path}: {} variables", raw.len());
            assert_eq!(raw, generic, "{path}");
            checked += 1;
        }
        assert!(checked >= 1);
    }

    /// Each offset takes the first entry that covers it; an offset no entry covers has
    /// none.
    #[test]
    fn an_offset_takes_the_first_symbol_that_covers_it() {
        let e = |start, end, index| SymbolEntry { start, end, index, dynamic: false };
        let entries = [e(100, 200, 1), e(150, 300, 2), e(400, 410, 3), e(100, 120, 4)];
        let found = covering_symbols(&[50, 100, 160, 250, 405, 410], entries.into_iter());
        let indices: Vec<Option<u32>> = found.iter().map(|f| f.map(|e| e.index)).collect();
        assert_eq!(indices, [None, Some(1), Some(1), Some(2), Some(3), None]);
    }

    /// The raw-table filter keeps what `object`'s generic symbols keep, on this test
    /// binary's own tables.
    #[test]
    fn raw_elf_symbols_are_the_generic_api_function_symbols() {
        use object::{Object, ObjectSymbol, SymbolKind};
        let exe = std::env::current_exe().unwrap();
        let data = std::fs::read(&exe).unwrap();
        let file = object::File::parse(&data[..]).unwrap();
        let generic: Vec<SymbolEntry> = [(false, file.symbols()), (true, file.dynamic_symbols())]
            .into_iter()
            .flat_map(|(dynamic, symbols)| {
                symbols
                    .filter(|s| s.address() != 0 && s.is_definition() && matches!(s.kind(), SymbolKind::Text | SymbolKind::Unknown))
                    .map(move |s| SymbolEntry { start: s.address(), end: s.address() + s.size(), index: s.index().0 as u32, dynamic })
            })
            .collect();
        let object::File::Elf64(elf) = &file else { panic!("not ELF64") };
        let raw: Vec<SymbolEntry> = elf_function_symbols(elf).collect();
        assert!(raw.len() > 1000, "{} symbols", raw.len());
        assert_eq!(raw, generic);
    }

    #[test]
    fn one_pass_agrees_with_a_sorted_index() {
        let mut rng = crate::test_rng::TestRng::new(0x2545_f491_4f6c_dd1d);
        let mut next = |n: u64| rng.below(n);
        for _ in 0..200 {
            let symbols: Vec<SymbolEntry> = (0..next(60)).map(|i| sym(next(4000), if next(3) == 0 { 0 } else { next(300) }, i as u32, next(2) == 0)).collect();
            let mut probes: Vec<u64> = (0..next(40)).map(|_| next(4500)).collect();
            probes.sort_unstable();
            assert_eq!(nearest_symbols(&probes, symbols.iter().copied()), by_index(&probes, &symbols), "{symbols:?} {probes:?}");
        }
    }
}
