//! Python frames, named off the hot path: a captured frame word (code id, instruction
//! offset) becomes function, file and line from the code registry's copy
//! (`hotpath::python::codes`), and the frames of a stack are placed where the
//! interpreter's native eval calls stand, the way a debugger shows a mixed stack.
use std::sync::Arc;

use super::build::Frame;
use crate::hotpath::python::{codes, word_code, word_is_entry, word_offset};
use crate::util::FxMap;

/// The line of the instruction at byte `offset` of a code object of CPython 3.`minor`,
/// from its line table: `co_lnotab` (3.9), the 3.10 `co_linetable`, or the location
/// table of 3.11 and later. `None` for an instruction with no line.
pub fn line_at(minor: u8, firstlineno: i32, table: &[u8], offset: u64) -> Option<u32> {
    let line = match minor {
        ..=9 => lnotab_line(firstlineno, table, offset),
        10 => linetable_310_line(firstlineno, table, offset),
        _ => location_table_line(firstlineno, table, offset),
    }?;
    u32::try_from(line).ok().filter(|&l| l > 0)
}

/// 3.9: pairs of (bytecode increment, signed line increment).
fn lnotab_line(first: i32, table: &[u8], offset: u64) -> Option<i64> {
    let (mut line, mut addr) = (first as i64, 0u64);
    for pair in table.chunks_exact(2) {
        addr += pair[0] as u64;
        if addr > offset {
            break;
        }
        line += pair[1] as i8 as i64;
    }
    Some(line)
}

/// 3.10: pairs of (bytes covered, signed line delta), -128 meaning "no line".
fn linetable_310_line(first: i32, table: &[u8], offset: u64) -> Option<i64> {
    let (mut line, mut end) = (first as i64, 0u64);
    for pair in table.chunks_exact(2) {
        let start = end;
        end += pair[0] as u64;
        let delta = pair[1] as i8;
        let this = if delta == -128 {
            None
        } else {
            line += delta as i64;
            Some(line)
        };
        if start <= offset && offset < end {
            return this;
        }
    }
    None
}

/// 3.11+: the location table of PEP 657 (Objects/locations.md). Each entry starts with
/// a byte whose top bit is set: bits 3–6 the form, bits 0–2 the code units covered − 1.
fn location_table_line(first: i32, table: &[u8], offset: u64) -> Option<i64> {
    let mut p = 0usize;
    let mut line = first as i64;
    let mut addr = 0u64;
    let varint = |p: &mut usize| -> Option<u64> {
        let mut b = *table.get(*p)?;
        *p += 1;
        let mut v = (b & 63) as u64;
        let mut shift = 0;
        while b & 64 != 0 {
            b = *table.get(*p)?;
            *p += 1;
            shift += 6;
            if shift > 60 {
                return None;
            }
            v |= ((b & 63) as u64) << shift;
        }
        Some(v)
    };
    let svarint = |p: &mut usize| -> Option<i64> {
        let u = varint(p)?;
        Some(if u & 1 != 0 { -((u >> 1) as i64) } else { (u >> 1) as i64 })
    };
    while p < table.len() {
        let head = table[p];
        p += 1;
        let code = (head >> 3) & 15;
        let end = addr + ((head & 7) as u64 + 1) * 2;
        let this = match code {
            15 => None,
            14 => {
                line += svarint(&mut p)?;
                varint(&mut p)?;
                varint(&mut p)?;
                varint(&mut p)?;
                Some(line)
            }
            13 => {
                line += svarint(&mut p)?;
                Some(line)
            }
            10..=12 => {
                line += (code - 10) as i64;
                p += 2;
                Some(line)
            }
            _ => {
                p += 1;
                Some(line)
            }
        };
        if addr <= offset && offset < end {
            return this;
        }
        addr = end;
    }
    None
}

/// A line of the user's own Python code: the code object it is in (its id) and the line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UserLine {
    pub code: u32,
    pub line: u32,
}

/// The id of a stack's Python part (`[PY_FRAMES, words…]`), if it has one: every stack
/// under the same Python lines shares it, so what depends on the Python frames alone is
/// worked out once per part (a few tens of thousands after `import torch`) rather than
/// once per stack (over a million).
pub fn python_part(stack: u32) -> Option<u32> {
    let frames = crate::hotpath::stacks::frames(stack)?;
    (frames.first() == Some(&crate::hotpath::python::PY_STACK)).then(|| frames.get(2).map(|&p| p as u32)).flatten()
}

/// The innermost frame of a Python part that lies in the user's own code
/// (`frame_text::is_user_python_file`), if it has one. None for memory allocated under
/// an import (a frame of the import machinery anywhere in the part): module loading is
/// start-up, and `import torch` alone rises for seconds, which would read as growth.
pub fn user_line_of_part(part: u32) -> Option<UserLine> {
    let frames = crate::hotpath::stacks::frames(part)?;
    if frames.first() != Some(&crate::hotpath::python::PY_FRAMES) {
        return None;
    }
    let mut user = None;
    for &w in &frames[1..] {
        let Some(rec) = codes::record(word_code(w)) else { continue };
        let Ok(file) = std::str::from_utf8(rec.filename()) else { continue };
        if leaktrace_common::frame_text::is_import_machinery(file) {
            return None;
        }
        if user.is_none() && leaktrace_common::frame_text::is_user_python_file(file) {
            user = line_at(rec.minor, rec.firstlineno, rec.line_table(), word_offset(w)).map(|line| UserLine { code: word_code(w), line });
        }
    }
    user
}

/// Function, file and line of a user line, for the report.
pub fn describe(l: UserLine) -> (String, String, u32) {
    match codes::record(l.code) {
        Some(rec) => (String::from_utf8_lossy(rec.name()).into_owned(), String::from_utf8_lossy(rec.filename()).into_owned(), l.line),
        None => ("?".into(), "?".into(), l.line),
    }
}

/// Named Python frames, each code id and offset worked out once.
#[derive(Default)]
pub struct PythonNames {
    frames: FxMap<u64, Frame>,
    /// One string per distinct file name and function name.
    strings: FxMap<Vec<u8>, Arc<str>>,
}

impl PythonNames {
    fn intern(&mut self, bytes: &[u8]) -> Arc<str> {
        if let Some(s) = self.strings.get(bytes) {
            return s.clone();
        }
        let s: Arc<str> = String::from_utf8_lossy(bytes).into();
        self.strings.insert(bytes.to_vec(), s.clone());
        s
    }

    /// The frame a captured word names (innermost information only: no native parts).
    pub fn frame(&mut self, word: u64) -> Frame {
        let key = word & !1;
        if let Some(f) = self.frames.get(&key) {
            return f.clone();
        }
        let offset = word_offset(word);
        let frame = match codes::record(word_code(word)) {
            Some(rec) => {
                let function = self.intern(rec.name());
                let file = self.intern(rec.filename());
                Frame {
                    ip: 0,
                    module: None,
                    offset: Some(offset),
                    function: Some(function),
                    file: Some(file),
                    line: line_at(rec.minor, rec.firstlineno, rec.line_table(), offset),
                    inlined: false,
                    python: true,
                }
            }
            None => Frame {
                ip: 0,
                module: None,
                offset: Some(offset),
                function: Some("<unknown Python code>".into()),
                file: None,
                line: None,
                inlined: false,
                python: true,
            },
        };
        self.frames.insert(key, frame.clone());
        frame
    }
}

/// Whether a native frame is an activation of the interpreter's eval loop: each runs one
/// or more Python frames (one before 3.11, an entry frame and the frames it calls
/// inline after).
pub fn is_eval_frame(f: &Frame) -> bool {
    f.function.as_deref().is_some_and(|n| n == "_PyEval_EvalFrameDefault" || n == "PyEval_EvalFrameEx" || n == "_PyEval_EvalFrame")
}

/// Places Python frames (innermost first, `words` as captured) in a native stack:
/// before each eval activation, the Python frames it runs (up to and including the
/// frame marked as its entry); frames left over when the native stack ends (it was cut
/// at its depth) follow at the end, outermost last.
pub fn merge(native: Vec<Frame>, words: &[u64], names: &mut PythonNames) -> Vec<Frame> {
    let mut out = Vec::with_capacity(native.len() + words.len());
    let mut next = 0usize;
    for f in native {
        // An eval call made of inlined parts shows as several frames of one ip: its
        // Python frames go before the first.
        let starts_activation = is_eval_frame(&f) && !f.inlined;
        if starts_activation && next < words.len() {
            while next < words.len() {
                let w = words[next];
                out.push(names.frame(w));
                next += 1;
                if word_is_entry(w) {
                    break;
                }
            }
        }
        out.push(f);
    }
    out.extend(words[next..].iter().map(|&w| names.frame(w)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lnotab_of_3_9() {
        // def f():          line 1
        //     a = 1         line 2: bytes 0..4
        //     b = 2         line 3: bytes 4..8
        let table = [0u8, 1, 4, 1];
        assert_eq!(line_at(9, 1, &table, 0), Some(2));
        assert_eq!(line_at(9, 1, &table, 5), Some(3));
        // A negative increment (a loop's jump back).
        let table = [0u8, 3, 6, (-2i8) as u8];
        assert_eq!(line_at(9, 10, &table, 7), Some(11));
    }

    #[test]
    fn linetable_of_3_10() {
        // 4 bytes on line first+1, 2 bytes with no line, 6 bytes on line first+3.
        let table = [4u8, 1, 2, 0x80, 6, 2];
        assert_eq!(line_at(10, 5, &table, 0), Some(6));
        assert_eq!(line_at(10, 5, &table, 4), None);
        assert_eq!(line_at(10, 5, &table, 10), Some(8));
        assert_eq!(line_at(10, 5, &table, 12), None);
    }

    #[test]
    fn location_table_forms() {
        let mut t = Vec::new();
        // Short form (code 0), 1 unit: same line as first; 1 byte of columns.
        t.extend([0x80, 0x00]);
        // One-line form code 11: line + 1, 2 units; two column bytes.
        t.extend([0x80 | (11 << 3) | 1, 4, 9]);
        // No-column form code 13: line delta -1 as svarint (3), 1 unit.
        t.extend([0x80 | (13 << 3), 3]);
        // Long form code 14: delta +5 (svarint 10), end line, columns; 1 unit.
        t.extend([0x80 | (14 << 3), 10, 0, 1, 2]);
        // No location (15), 1 unit.
        t.extend([0x80 | (15 << 3)]);
        assert_eq!(line_at(12, 20, &t, 0), Some(20));
        assert_eq!(line_at(12, 20, &t, 2), Some(21));
        assert_eq!(line_at(12, 20, &t, 4), Some(21));
        assert_eq!(line_at(12, 20, &t, 6), Some(20));
        assert_eq!(line_at(12, 20, &t, 8), Some(25));
        assert_eq!(line_at(12, 20, &t, 10), None);
        assert_eq!(line_at(12, 20, &t, 12), None);
        // A varint spread over two bytes: 64 + 2 = 66 → +33 lines.
        let t = [0x80 | (13 << 3), 0x40 | 2, 1];
        assert_eq!(line_at(13, 1, &t, 0), Some(34));
    }

    fn native(name: &str, inlined: bool) -> Frame {
        Frame { ip: 1, module: None, offset: None, function: Some(name.into()), file: None, line: None, inlined, python: false }
    }

    #[test]
    fn python_frames_stand_where_the_eval_calls_do() {
        let mut names = PythonNames::default();
        let w = |code: u32, entry: bool| crate::hotpath::python::frame_word(code, 0, entry);
        // Two activations: the inner runs two frames (inline call), the outer one.
        let words = [w(1, false), w(2, true), w(3, true), w(4, true)];
        let stack = vec![
            native("malloc_site", false),
            native("_PyEval_EvalFrameDefault", false),
            native("_PyFunction_Vectorcall", false),
            native("_PyEval_EvalFrameDefault", false),
            native("main", false),
        ];
        let merged = merge(stack, &words, &mut names);
        let kinds: Vec<bool> = merged.iter().map(|f| f.python).collect();
        assert_eq!(kinds, [false, true, true, false, false, true, false, false, true]);
        assert!(merged[8].python, "the leftover frame goes last");
    }
}
