//! "Held by" as people read it: one line naming each holder of a path from a reachable
//! block out to its root (`report_schema::HeldLink`), innermost first, e.g.
//! `held by: host block (24 B) from cache_insert (cache.c:12) at +16 ← global g_cache (cache)`.
use crate::report_schema::{Frame, HeldLink};

/// "function (file:line)" of the first frame a reader would look at: the frames-only
/// view of a Python stack (its innermost Python frame), else the innermost named frame.
pub fn site(stack: &[Frame]) -> Option<String> {
    let view = crate::frame_text::frames_only_view(stack);
    let f = view.iter().map(|&i| &stack[i]).find(|f| f.function.is_some())?;
    let name = f.function.as_deref()?;
    Some(match (&f.file, f.line) {
        (Some(file), Some(line)) => format!("{name} ({}:{line})", base_name(file)),
        _ => name.to_string(),
    })
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn bytes(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// One link in words.
pub fn link_text(l: &HeldLink) -> String {
    let thread = |t: Option<u32>| t.map_or_else(|| "a thread".to_string(), |t| format!("thread {t}"));
    match l.kind.as_ref() {
        "global" | "cuda_library" => {
            let module = l.module.as_deref().map(base_name).unwrap_or("?");
            let what = if l.kind == "global" { "global" } else { "CUDA library data" };
            match &l.symbol {
                Some(s) if l.offset > 0 => format!("{what} {s} (+{}) ({module})", l.offset),
                Some(s) => format!("{what} {s} ({module})"),
                None => format!("{what} at +{:#x} of {module}", l.offset),
            }
        }
        "stack" => match &l.function {
            Some(f) => format!("stack of {} in {f}", thread(l.thread)),
            None => format!("stack of {}", thread(l.thread)),
        },
        "registers" => format!("registers of {}", thread(l.thread)),
        "tls" => "thread-local storage".into(),
        "root_region" => "a registered root region or ignored block".into(),
        "inherited" => "a block the parent process allocated".into(),
        "python_object" => match &l.type_name {
            Some(t) => format!("{t} (Python object, +{})", l.offset),
            None => format!("a Python object (+{})", l.offset),
        },
        "elided" => format!("… {} more …", l.elided.unwrap_or(0)),
        "unscanned" => "no reference (the loader's, or marked ignored)".into(),
        "root" => "a root".into(),
        kind => {
            let size = l.size.map(|s| format!(" ({})", bytes(s))).unwrap_or_default();
            let from = l.stack.as_deref().and_then(site).map(|s| format!(" from {s}")).unwrap_or_default();
            format!("{kind} block{size}{from} at +{}", l.offset)
        }
    }
}

/// `held by: a ← b ← root`, or `None` for an empty path.
pub fn held_by_text(links: &[HeldLink]) -> Option<String> {
    if links.is_empty() {
        return None;
    }
    Some(format!("held by: {}", links.iter().map(link_text).collect::<Vec<_>>().join(" ← ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_reads_from_the_block_out_to_its_root() {
        let frame = Frame { function: Some("cache_insert".into()), file: Some("/src/cache.c".into()), line: Some(12), ..Default::default() };
        let links = vec![
            HeldLink {
                kind: "host".into(),
                offset: 16,
                api: Some("malloc".into()),
                size: Some(24),
                stack_id: Some(3),
                stack: Some(vec![frame]),
                ..Default::default()
            },
            HeldLink { kind: "elided".into(), elided: Some(9998), ..Default::default() },
            HeldLink { kind: "global".into(), symbol: Some("g_cache".into()), module: Some("/tmp/cache".into()), ..Default::default() },
        ];
        assert_eq!(held_by_text(&links).unwrap(), "held by: host block (24 B) from cache_insert (cache.c:12) at +16 ← … 9998 more … ← global g_cache (cache)");
        let stack = HeldLink { kind: "stack".into(), thread: Some(42), function: Some("worker (cache.c:30)".into()), ..Default::default() };
        assert_eq!(link_text(&stack), "stack of thread 42 in worker (cache.c:30)");
        let py = HeldLink { kind: "python_object".into(), type_name: Some("bytearray".into()), offset: 32, ..Default::default() };
        assert_eq!(link_text(&py), "bytearray (Python object, +32)");
        assert_eq!(held_by_text(&[]), None);
    }
}
