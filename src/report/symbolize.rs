//! Off the hot path: raw return addresses -> (module, offset) -> function, file, line.
//!
//! Module resolution must happen while the module is still mapped, so it runs at every
//! report and, for every stack interned so far, just before each `dlclose`. Names are
//! then read from the module *file* (DWARF via addr2line, else the symbol table), which
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
    ip_modules: FxMap<u64, Option<(u32, u64)>>,
    stacks: Vec<Option<Vec<RawFrame>>>,
    resolved_upto: u32,
    loaders: FxMap<u32, Option<addr2line::Loader>>,
    symbols: FxMap<(u32, u64), Vec<SymFrame>>,
}

impl Symbolizer {
    pub fn new(exe_path: String) -> Symbolizer {
        Symbolizer { exe_path, resolved_upto: 1, ..Default::default() }
    }

    pub fn module(&self, idx: u32) -> Option<&Module> {
        self.modules.get(idx as usize)
    }

    fn module_for_ip(&mut self, ip: u64) -> Option<(u32, u64)> {
        if let Some(m) = self.ip_modules.get(&ip) {
            return *m;
        }
        let found = unwind::module_of(ip).map(|m| {
            let path = if m.path.is_empty() { self.exe_path.clone() } else { m.path };
            let key = (path.clone(), m.base, m.start);
            let next = self.modules.len() as u32;
            let idx = *self.module_ids.entry(key).or_insert(next);
            if idx == next {
                self.modules.push(Module { path, base: m.base, start: m.start, end: m.end });
            }
            (idx, ip.wrapping_sub(m.base))
        });
        self.ip_modules.insert(ip, found);
        found
    }

    /// Maps every stack interned so far to modules (call while they are all loaded).
    pub fn resolve_pending(&mut self) {
        let count = stacks::count();
        while self.resolved_upto < count {
            let id = self.resolved_upto;
            let Some(frames) = stacks::frames(id) else { break };
            let raw: Vec<RawFrame> = frames.iter().map(|&ip| RawFrame { ip, module: self.module_for_ip(ip) }).collect();
            let idx = id as usize;
            if self.stacks.len() <= idx {
                self.stacks.resize(idx + 1, None);
            }
            self.stacks[idx] = Some(raw);
            self.resolved_upto += 1;
        }
    }

    /// After a dlclose the same addresses may come to mean another module.
    pub fn forget_address_cache(&mut self) {
        self.ip_modules.clear();
    }

    pub fn raw_stack(&self, id: u32) -> &[RawFrame] {
        self.stacks.get(id as usize).and_then(|s| s.as_deref()).unwrap_or(&[])
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

    /// Function/file/line for a return address (innermost inlined frame first).
    pub fn symbolize(&mut self, module: u32, offset: u64) -> &[SymFrame] {
        if !self.symbols.contains_key(&(module, offset)) {
            // A return address points after the call; look up the call instruction.
            let probe = offset.saturating_sub(1);
            let frames = match self.loader(module) {
                Some(loader) => lookup(loader, probe),
                None => Vec::new(),
            };
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
    if out.iter().all(|f| f.function.is_none()) {
        if let Some(sym) = loader.find_symbol(probe) {
            let name = addr2line::demangle_auto(Cow::Borrowed(sym), None).into_owned();
            match out.last_mut() {
                Some(last) => last.function = Some(name),
                None => out.push(SymFrame { function: Some(name), ..Default::default() }),
            }
        }
    }
    out
}
