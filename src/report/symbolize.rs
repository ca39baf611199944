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
use std::collections::HashMap;

use crate::collector::state::FxMap;
use crate::hotpath::{stacks, unwind};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    pub path: String,
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
    pub function: Option<String>,
    pub file: Option<String>,
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
    loaders: FxMap<u32, Option<addr2line::Loader>>,
    /// Symbol tables of modules whose DWARF (if any) did not name a function.
    symbol_tables: FxMap<u32, Option<SymbolTable>>,
    symbols: FxMap<(u32, u64), Vec<SymFrame>>,
}

/// A module's ELF symbol table, sorted by address, with names read only for the
/// symbols asked for. addr2line's own fallback decodes every name first: libtorch_cpu
/// has 546k symbols and 78 MB of names, 120 ms of each forked worker's final report.
struct SymbolTable {
    map: memmap2::Mmap,
    /// `(start, end or start when the size is unknown, index, from .dynsym)`.
    entries: Vec<(u64, u64, u32, bool)>,
}

impl SymbolTable {
    fn load(path: &str) -> Option<SymbolTable> {
        use object::{Object, ObjectSymbol, SymbolKind};
        let map = crate::hotpath::mapping::map_file(path)?;
        let file = object::File::parse(&*map).ok()?;
        let mut entries: Vec<(u64, u64, u32, bool)> = Vec::new();
        for (dynamic, symbols) in [(false, file.symbols()), (true, file.dynamic_symbols())] {
            for s in symbols {
                if s.address() != 0 && s.is_definition() && matches!(s.kind(), SymbolKind::Text | SymbolKind::Unknown) {
                    entries.push((s.address(), s.address().saturating_add(s.size()), s.index().0 as u32, dynamic));
                }
            }
        }
        entries.sort_unstable_by_key(|e| e.0);
        Some(SymbolTable { map, entries })
    }

    /// The name of the function that holds `probe` (an address in the file's terms).
    fn name_of(&self, probe: u64) -> Option<String> {
        use object::{Object, ObjectSymbol, ObjectSymbolTable, SymbolIndex};
        let i = self.entries.partition_point(|e| e.0 <= probe).checked_sub(1)?;
        let (start, end, index, dynamic) = self.entries[i];
        // A symbol of known size must cover the address; one of unknown size (some
        // assembly routines) is taken as reaching up to the next symbol.
        if end > start && probe >= end {
            return None;
        }
        let file = object::File::parse(&*self.map).ok()?;
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
            self.modules.push(Module { path, base, start, end });
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

    fn loader(&mut self, module: u32) -> Option<&addr2line::Loader> {
        if !self.loaders.contains_key(&module) {
            let loader = self
                .modules
                .get(module as usize)
                .filter(|m| m.path.starts_with('/'))
                .and_then(|m| addr2line::Loader::new(&m.path).ok());
            self.loaders.insert(module, loader);
        }
        self.loaders.get(&module).and_then(|l| l.as_ref())
    }

    fn symbol_table(&mut self, module: u32) -> Option<&SymbolTable> {
        if !self.symbol_tables.contains_key(&module) {
            let table = self.modules.get(module as usize).filter(|m| m.path.starts_with('/')).and_then(|m| SymbolTable::load(&m.path));
            self.symbol_tables.insert(module, table);
        }
        self.symbol_tables.get(&module).and_then(|t| t.as_ref())
    }

    /// Function/file/line for a return address (innermost inlined frame first).
    pub fn symbolize(&mut self, module: u32, offset: u64) -> &[SymFrame] {
        if !self.symbols.contains_key(&(module, offset)) {
            // A return address points after the call; look up the call instruction.
            let probe = offset.saturating_sub(1);
            let mut frames = match self.loader(module) {
                Some(loader) => lookup(loader, probe),
                None => Vec::new(),
            };
            if frames.iter().all(|f| f.function.is_none()) {
                if let Some(name) = self.symbol_table(module).and_then(|t| t.name_of(probe)) {
                    match frames.last_mut() {
                        Some(last) => last.function = Some(name),
                        None => frames.push(SymFrame { function: Some(name), ..Default::default() }),
                    }
                }
            }
            self.symbols.insert((module, offset), frames);
        }
        &self.symbols[&(module, offset)]
    }
}

fn lookup(loader: &addr2line::Loader, probe: u64) -> Vec<SymFrame> {
    let mut out = Vec::new();
    if let Ok(mut iter) = loader.find_frames(probe) {
        while let Ok(Some(frame)) = iter.next() {
            let function = frame.function.as_ref().and_then(|f| f.demangle().ok()).map(|c| c.into_owned());
            let (file, line) = match frame.location {
                Some(loc) => (loc.file.map(str::to_owned), loc.line),
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
