//! Off the hot path: raw return addresses -> (module, offset) -> function, file, line.
//!
//! An address means a module only while that module is mapped. Stacks are tagged with
//! the dlclose epoch they were captured in, and just before each `dlclose` the list of
//! loaded modules is kept for the epoch that is ending (one `dl_iterate_phdr`, nothing
//! per stack), so a stack from an earlier epoch is resolved against the modules of its
//! own epoch, and one from the current epoch against the live loader. Names are then
//! read from the module *file* (DWARF via addr2line, else the symbol table), which
//! still works after the module was unloaded.
use std::sync::Arc;
use std::borrow::Cow;
use std::collections::HashMap;

use crate::collector::state::FxMap;
use crate::hotpath::{stacks, unwind};

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
    module_ids: HashMap<(String, u64, u64), u32>,
    /// Module of an address in the epoch `ip_modules_epoch` (the current one).
    ip_modules: FxMap<u64, Option<(u32, u64)>>,
    ip_modules_epoch: u32,
    /// For each ended epoch, the modules loaded when it ended: (start, end, module),
    /// sorted by start.
    ended_epochs: FxMap<u32, Vec<(u64, u64, u32)>>,
    files: FxMap<u32, Option<ModuleFile>>,
    symbols: FxMap<(u32, u64), Vec<SymFrame>>,
}

type Reader = gimli::EndianSlice<'static, gimli::RunTimeEndian>;

/// A module file, mapped for the rest of the process (the symbolizer keeps every module
/// it met; unloaded ones are still named from their files): its DWARF, if any, and its
/// ELF symbol table, read through an index of our own whose names are decoded only for
/// the symbols a report asks for. addr2line's `Loader` decodes every symbol name when it
/// opens a file: libtorch_cpu has 546k symbols and 78 MB of names, ~120 ms of each
/// forked worker's final report.
struct ModuleFile {
    file: object::File<'static>,
    dwarf: Option<addr2line::Context<Reader>>,
    /// `(start, end or start when the size is unknown, index, from .dynsym)`, by start;
    /// built on the first lookup DWARF cannot answer.
    symbols: Option<Vec<(u64, u64, u32, bool)>>,
}

impl ModuleFile {
    fn open(path: &str) -> Option<ModuleFile> {
        use object::{Object, ObjectSection};
        let map: &'static memmap2::Mmap = Box::leak(Box::new(crate::hotpath::mapping::map_file(path)?));
        let file = object::File::parse(&map[..]).ok()?;
        let endian = if file.is_little_endian() { gimli::RunTimeEndian::Little } else { gimli::RunTimeEndian::Big };
        let dwarf = file.section_by_name(".debug_info").is_some().then(|| {
            let dwarf = gimli::Dwarf::load(|id| -> Result<Reader, gimli::Error> {
                let data: &'static [u8] = match file.section_by_name(id.name()).map(|s| s.uncompressed_data()) {
                    Some(Ok(std::borrow::Cow::Borrowed(b))) => b,
                    // Compressed debug sections: kept, like the mapping, for the process.
                    Some(Ok(std::borrow::Cow::Owned(b))) => Box::leak(b.into_boxed_slice()),
                    _ => &[],
                };
                Ok(gimli::EndianSlice::new(data, endian))
            });
            dwarf.ok().and_then(|d| addr2line::Context::from_dwarf(d).ok())
        });
        Some(ModuleFile { file, dwarf: dwarf.flatten(), symbols: None })
    }

    fn frames(&self, probe: u64) -> Vec<SymFrame> {
        let mut out = Vec::new();
        let Some(ctx) = &self.dwarf else { return out };
        if let Ok(mut iter) = ctx.find_frames(probe).skip_all_loads() {
            while let Ok(Some(frame)) = iter.next() {
                let function = frame.function.as_ref().and_then(|f| f.demangle().ok()).map(|c| Arc::from(c.as_ref()));
                let (file, line) = match frame.location {
                    Some(loc) => (loc.file.map(Arc::from), loc.line),
                    None => (None, None),
                };
                out.push(SymFrame { function, file, line, inlined: true });
            }
        }
        if let Some(last) = out.last_mut() {
            last.inlined = false;
        }
        out
    }

    /// The name of the function that holds `probe` (an address in the file's terms).
    fn symbol_name(&mut self, probe: u64) -> Option<String> {
        use object::{Object, ObjectSymbol, ObjectSymbolTable, SymbolIndex, SymbolKind};
        let file = &self.file;
        let entries = self.symbols.get_or_insert_with(|| {
            let mut entries = Vec::new();
            for (dynamic, symbols) in [(false, file.symbols()), (true, file.dynamic_symbols())] {
                for s in symbols {
                    if s.address() != 0 && s.is_definition() && matches!(s.kind(), SymbolKind::Text | SymbolKind::Unknown) {
                        entries.push((s.address(), s.address().saturating_add(s.size()), s.index().0 as u32, dynamic));
                    }
                }
            }
            entries.sort_unstable_by_key(|e| e.0);
            entries
        });
        let i = entries.partition_point(|e| e.0 <= probe).checked_sub(1)?;
        let (start, end, index, dynamic) = entries[i];
        // A symbol of known size must cover the address; one of unknown size (some
        // assembly routines) is taken as reaching up to the next symbol.
        if end > start && probe >= end {
            return None;
        }
        let table = if dynamic { file.dynamic_symbol_table()? } else { file.symbol_table()? };
        let name = table.symbol_by_index(SymbolIndex(index as usize)).ok()?.name().ok()?;
        Some(addr2line::demangle_auto(Cow::Borrowed(name), None).into_owned())
    }
}

impl Symbolizer {
    pub fn new(exe_path: String) -> Symbolizer {
        Symbolizer { exe_path, ..Default::default() }
    }

    pub fn module(&self, idx: u32) -> Option<&Module> {
        self.modules.get(idx as usize)
    }

    fn module_index(&mut self, path: String, base: u64, start: u64, end: u64) -> u32 {
        let path = if path.is_empty() { self.exe_path.clone() } else { path };
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
        let pinned: Vec<(u64, u64, u32)> = crate::interpose::resolve::loaded_modules()
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

    /// A captured stack's frames with their modules (innermost first).
    pub fn raw_stack(&mut self, id: u32) -> Vec<RawFrame> {
        let (frames, epoch) = stacks::frames_and_epoch(id).unwrap_or_default();
        if epoch == unwind::epoch() {
            return frames.iter().map(|&ip| RawFrame { ip, module: self.module_for_ip(ip) }).collect();
        }
        let ended = self.ended_epochs.get(&epoch).map(Vec::as_slice).unwrap_or(&[]);
        frames
            .iter()
            .map(|&ip| {
                let i = ended.partition_point(|m| m.0 <= ip);
                let module = i
                    .checked_sub(1)
                    .map(|i| ended[i])
                    .filter(|m| ip < m.1)
                    .map(|(_, _, idx)| (idx, ip.wrapping_sub(self.modules[idx as usize].base)));
                RawFrame { ip, module }
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

    /// Function/file/line for a return address (innermost inlined frame first).
    pub fn symbolize(&mut self, module: u32, offset: u64) -> &[SymFrame] {
        if !self.symbols.contains_key(&(module, offset)) {
            // A return address points after the call; look up the call instruction.
            let probe = offset.saturating_sub(1);
            let frames = match self.file(module) {
                Some(file) => {
                    let mut frames = file.frames(probe);
                    if frames.iter().all(|f| f.function.is_none()) {
                        if let Some(name) = file.symbol_name(probe) {
                            match frames.last_mut() {
                                Some(last) => last.function = Some(name.into()),
                                None => frames.push(SymFrame { function: Some(name.into()), ..Default::default() }),
                            }
                        }
                    }
                    frames
                }
                None => Vec::new(),
            };
            self.symbols.insert((module, offset), frames);
        }
        &self.symbols[&(module, offset)]
    }
}

