//! One stack frame as LeakSanitizer prints it:
//! `    #3 0x55d0c0a0115a in train_step /src/x.c:28 (/bin/x+0x115a)`; a Python frame as
//! `    #5 in Model.forward /work/train.py:41 [python]`.
//!
//! And the frames-only view of a stack that has Python frames: the native frames up to
//! the first Python frame (where the memory was allocated), then only Python frames,
//! each import's run of import-machinery frames folded to its outermost one.

use crate::report_schema::Frame;

pub fn frame_line(index: usize, f: &Frame) -> String {
    let mut s = if f.python { format!("    #{index} in {}", f.function.as_deref().unwrap_or("?")) } else { format!("    #{index} {:#x}", f.ip) };
    if let (Some(func), false) = (&f.function, f.python) {
        s.push_str(" in ");
        s.push_str(func);
    }
    if let Some(file) = &f.file {
        s.push(' ');
        s.push_str(file);
        if let Some(line) = f.line {
            s.push_str(&format!(":{line}"));
        }
    }
    match (&f.module, f.offset) {
        (Some(m), Some(off)) => s.push_str(&format!(" ({m}+{off:#x})")),
        (Some(m), None) => s.push_str(&format!(" ({m})")),
        _ => {}
    }
    if f.python {
        s.push_str(" [python]");
        return s;
    }
    if f.inlined {
        s.push_str(" [inlined]");
    }
    s
}

/// The frames the frames-only view shows of a stack whose frames are Python frames or
/// not (`is_python`, innermost first): every native frame before the first Python
/// frame, then the Python frames alone. A stack without Python frames is shown whole.
pub fn python_view(is_python: &[bool]) -> Vec<usize> {
    let Some(first) = is_python.iter().position(|&p| p) else {
        return (0..is_python.len()).collect();
    };
    (0..first).chain((first..is_python.len()).filter(|&i| is_python[i])).collect()
}

/// The frames the text, Markdown and HTML renderings show of `stack` by default:
/// `python_view`, with each run of import-machinery frames folded to its outermost
/// frame. An `import` puts five frames of `importlib._bootstrap` (`_find_and_load` …
/// `_call_with_frames_removed`) between the importing line and the imported module's
/// code — 34 of the 43 Python frames of the average allocation in `import torch` —
/// and CPython's own tracebacks leave them out. The outermost of a run stays, so a
/// chain of imports still reads as one (`<module> pkg/__init__.py` ← `_find_and_load` ←
/// `<module> train.py`), and so does the first Python frame, where the memory was
/// allocated, when the machinery itself allocated it.
pub fn frames_only_view(stack: &[Frame]) -> Vec<usize> {
    let shown = python_view(&stack.iter().map(|f| f.python).collect::<Vec<_>>());
    let import = |k: usize| is_import_frame(&stack[k]);
    let first_python = shown.iter().position(|&k| stack[k].python);
    shown
        .iter()
        .enumerate()
        .filter(|&(j, &k)| !import(k) || Some(j) == first_python || shown.get(j + 1).is_none_or(|&outer| !import(outer)))
        .map(|(_, &k)| k)
        .collect()
}

/// What a view (`frames_only_view`) leaves out of `stack`, as a sentence without its
/// end (`None`: nothing): `3 native frame(s) between Python frames and 8
/// import-machinery frame(s) not shown`.
pub fn hidden_frames_text(stack: &[Frame], shown: &[usize]) -> Option<String> {
    let hidden_import = stack.iter().filter(|f| is_import_frame(f)).count() - shown.iter().filter(|&&k| is_import_frame(&stack[k])).count();
    let hidden_native = (stack.len() - shown.len()) - hidden_import;
    match (hidden_native, hidden_import) {
        (0, 0) => None,
        (n, 0) => Some(format!("{n} native frame(s) between Python frames not shown")),
        (0, m) => Some(format!("{m} import-machinery frame(s) not shown")),
        (n, m) => Some(format!("{n} native frame(s) between Python frames and {m} import-machinery frame(s) not shown")),
    }
}

/// Whether a Python source file is the user's own code: not the standard library, not
/// an installed package, not frozen or generated code.
pub fn is_user_python_file(file: &str) -> bool {
    !(file.starts_with('<')
        || file.contains("/site-packages/")
        || file.contains("/dist-packages/")
        || file.contains("/lib/python3")
        || file.contains("/lib64/python3")
        || file.contains("/usr/lib/python"))
}

/// Whether a Python source file is the import machinery (`importlib._bootstrap` and
/// `_bootstrap_external`, frozen into the interpreter): memory allocated under one of its
/// frames is made by an import, which is start-up, never a training loop's growth.
pub fn is_import_machinery(file: &str) -> bool {
    file.starts_with("<frozen importlib._bootstrap")
}

/// Whether `f` is a Python frame of the import machinery (`is_import_machinery`).
pub fn is_import_frame(f: &Frame) -> bool {
    f.python && f.file.as_deref().is_some_and(is_import_machinery)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn import_machinery_is_the_frozen_bootstrap_only() {
        assert!(is_import_machinery("<frozen importlib._bootstrap>"));
        assert!(is_import_machinery("<frozen importlib._bootstrap_external>"));
        assert!(!is_import_machinery("/usr/lib/python3.11/importlib/__init__.py"));
        assert!(!is_import_machinery("/w/train.py"));
    }

    #[test]
    fn lsan_shape() {
        let text = |s: &str| Some(std::sync::Arc::from(s));
        let f = Frame {
            ip: 0x1234,
            function: text("leak_here"),
            file: text("/src/x.c"),
            line: Some(12),
            module: text("/bin/x"),
            offset: Some(0x234),
            ..Default::default()
        };
        assert_eq!(frame_line(0, &f), "    #0 0x1234 in leak_here /src/x.c:12 (/bin/x+0x234)");
        let bare = Frame { ip: 0x9, inlined: true, ..Default::default() };
        assert_eq!(frame_line(7, &bare), "    #7 0x9 [inlined]");
        let py = Frame { function: text("Model.forward"), file: text("/w/train.py"), line: Some(41), offset: Some(12), python: true, ..Default::default() };
        assert_eq!(frame_line(5, &py), "    #5 in Model.forward /w/train.py:41 [python]");
    }

    #[test]
    fn python_view_keeps_the_allocating_native_frames_then_python_frames() {
        assert_eq!(python_view(&[false, false]), vec![0, 1]);
        assert_eq!(python_view(&[false, false, true, false, true, false]), vec![0, 1, 2, 4]);
        assert_eq!(python_view(&[true, false]), vec![0]);
    }

    #[test]
    fn each_imports_machinery_folds_to_its_outermost_frame() {
        let text = |s: &str| Some(std::sync::Arc::from(s));
        let native = || Frame { ip: 1, ..Default::default() };
        let py = |file: &str| Frame { function: text("f"), file: text(file), python: true, ..Default::default() };
        const BOOT: &str = "<frozen importlib._bootstrap>";
        const EXTERNAL: &str = "<frozen importlib._bootstrap_external>";
        // malloc, ctypes, leakmod.py (two frames), an import's five machinery frames with
        // native frames among them, pkg.py, another import, main.py.
        let stack = vec![
            native(),
            native(),
            py("/w/leakmod.py"),
            py("/w/leakmod.py"),
            py(BOOT),
            native(),
            py(EXTERNAL),
            py(BOOT),
            py(BOOT),
            py(BOOT),
            native(),
            py("/w/pkg.py"),
            py(BOOT),
            py(BOOT),
            py("/w/main.py"),
        ];
        let shown = frames_only_view(&stack);
        assert_eq!(shown, vec![0, 1, 2, 3, 9, 11, 13, 14]);
        assert_eq!(hidden_frames_text(&stack, &shown).as_deref(), Some("2 native frame(s) between Python frames and 5 import-machinery frame(s) not shown"));
        // Memory the machinery allocated itself keeps the frame where it was allocated.
        let own = vec![native(), py(BOOT), py(BOOT), py(EXTERNAL), py("/w/main.py")];
        assert_eq!(frames_only_view(&own), vec![0, 1, 3, 4]);
        assert_eq!(hidden_frames_text(&own, &frames_only_view(&own)).as_deref(), Some("1 import-machinery frame(s) not shown"));
        // No machinery: the plain frames-only view; no Python: the whole stack.
        let plain = vec![native(), py("/w/a.py"), native(), py("/w/b.py")];
        assert_eq!(frames_only_view(&plain), vec![0, 1, 3]);
        assert_eq!(hidden_frames_text(&plain, &[0, 1, 3]).as_deref(), Some("1 native frame(s) between Python frames not shown"));
        assert_eq!(frames_only_view(&[native(), native()]), vec![0, 1]);
        assert_eq!(hidden_frames_text(&[native(), native()], &[0, 1]), None);
    }

    #[test]
    fn user_files() {
        assert!(is_user_python_file("/home/me/train.py"));
        assert!(is_user_python_file("train.py"));
        assert!(!is_user_python_file("/usr/lib/python3.11/threading.py"));
        assert!(!is_user_python_file("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/nn/modules/module.py"));
        assert!(!is_user_python_file("<frozen importlib._bootstrap>"));
        assert!(!is_user_python_file("/venv/lib/python3.12/site-packages/x.py"));
    }
}
