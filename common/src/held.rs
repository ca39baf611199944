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
        "inherited" => "a block allocated before recording began (by the parent process, or before the attach)".into(),
        "python_object" => match (&l.type_name, &l.symbol) {
            (Some(t), Some(name)) if t == "module" => format!("module {name}"),
            (Some(t), _) if l.attribute => format!("an attribute of a {t} object"),
            // A list's item array (`ob_item`) or a dict's entries (`ma_keys`): the container.
            (Some(t), _) if (t == "list" && l.offset == 24) || (t == "dict" && l.offset == 32) => t.clone(),
            // A tuple's items follow its reference count, type and length.
            (Some(t), _) if t == "tuple" && l.offset >= 24 && l.offset % 8 == 0 => format!("tuple[{}]", (l.offset - 24) / 8),
            (Some(t), _) => format!("{t} (Python object, +{})", l.offset),
            (None, _) => match &l.key {
                Some(k) => format!("the entry {k:?} of a dict"),
                None => format!("a Python object (+{})", l.offset),
            },
        },
        "python_local" => match (&l.symbol, &l.function) {
            (Some(name), Some(f)) => format!("local {name} of {f}"),
            (None, Some(f)) => format!("a value on the stack of {f}"),
            (Some(name), None) => format!("local {name} of a running Python function"),
            (None, None) => "a running Python function's frame".into(),
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

/// Whether `values` is a raw block that `object`'s pre-header points to: the object's
/// attribute values (3.11+), with no keys between them.
pub fn are_attribute_values(values: &HeldLink, object: Option<&HeldLink>) -> bool {
    values.kind == "python_object" && values.type_name.is_none() && object.is_some_and(|o| o.kind == "python_object" && o.attribute)
}

/// Types whose dicts are items, never an instance's `__dict__` (`phrases`).
const CONTAINERS: &[&str] = &["module", "tuple", "list", "dict", "set", "frozenset", "cell", "collections.deque"];

fn python_type(l: Option<&HeldLink>) -> Option<&str> {
    l.filter(|l| l.kind == "python_object").and_then(|l| l.type_name.as_deref())
}

/// The phrases of a path, Python containers folded the way their code names them: a
/// list's items and the list are `list[i]`, a dict's entry and the dict `dict['key']`,
/// and a module's dict `global NAME of module M`.
pub fn phrases(links: &[HeldLink]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < links.len() {
        let l = &links[i];
        let next = links.get(i + 1);
        // What may own a dict as an instance's `__dict__`: no container, whose dicts are
        // its items (a dict in a tuple: "attribute v of a tuple object" had said so).
        let owner = python_type(links.get(i + 2)).filter(|t| !CONTAINERS.contains(t));
        if let (Some(key), Some("dict")) = (&l.key, python_type(next)) {
            if let (Some("module"), Some(name)) = (python_type(links.get(i + 2)), links.get(i + 2).and_then(|m| m.symbol.as_deref())) {
                out.push(format!("global {key} of module {name}"));
                i += 3;
            } else if let Some(t) = owner.filter(|_| links[i + 2].offset > 0) {
                // An instance's `__dict__` (before 3.11).
                out.push(format!("attribute {key} of a {t} object"));
                i += 3;
            } else {
                out.push(format!("dict[{key:?}]"));
                i += 2;
            }
            continue;
        }
        // An instance's split `__dict__` before 3.11: its values (a raw block), the dict
        // (`ma_values`), the instance.
        if l.kind == "python_object" && l.type_name.is_none() && l.key.is_none() && python_type(next) == Some("dict") && next.is_some_and(|n| n.offset == 40) {
            if let Some(t) = owner {
                out.push(format!("an attribute of a {t} object"));
                i += 3;
                continue;
            }
        }
        // An object's attribute values (a raw block beside it, 3.11+) and the object. The
        // values have no keys between them: a key read before one is the value of the
        // attribute before it, not its name ("the entry \"request %d done: %s\" of a
        // dict ← an attribute of a LogRecord object": `msg`'s value, for `args`).
        if are_attribute_values(l, next) {
            out.push(link_text(next.expect("checked")));
            i += 2;
            continue;
        }
        // A dict's entries (its keys object, at `ma_keys`) and the dict, the key not named
        // (not a string).
        if l.kind != "python_object" && l.key.is_none() && python_type(next) == Some("dict") && next.is_some_and(|n| n.offset == 32) {
            out.push("a value of a dict".into());
            i += 2;
            continue;
        }
        // A list's `ob_item` (after the reference count, the type and the length).
        if python_type(next) == Some("list") && next.is_some_and(|n| n.offset == 24) && l.offset % 8 == 0 && l.kind != "python_object"
            || (l.kind == "python_object" && l.type_name.is_none() && python_type(next) == Some("list"))
        {
            out.push(format!("list[{}]", l.offset / 8));
            i += 2;
            continue;
        }
        out.push(link_text(l));
        i += 1;
    }
    out
}

/// `held by: a ← b ← root`, or `None` for an empty path. Runs of one holder (the nodes of
/// a linked list) are said once with their count, across the links a long path left
/// out between them.
pub fn held_by_text(links: &[HeldLink]) -> Option<String> {
    if links.is_empty() {
        return None;
    }
    // (phrase, times), with `None` for the links left out (their count).
    let mut runs: Vec<(Option<String>, u64)> = Vec::new();
    for p in phrases_with_links(links) {
        match p {
            Phrase::Elided(n) => runs.push((None, n)),
            Phrase::Text(t) => match runs.last_mut() {
                Some((Some(last), n)) if *last == t => *n += 1,
                _ => runs.push((Some(t), 1)),
            },
        }
    }
    // X ×a, (n left out), X ×b: one run of a + n + b.
    let mut merged: Vec<(Option<String>, u64)> = Vec::new();
    for r in runs {
        let n = merged.len();
        if n >= 2 && merged[n - 1].0.is_none() && merged[n - 2].0.is_some() && merged[n - 2].0 == r.0 {
            let left_out = merged.pop().expect("checked").1;
            merged[n - 2].1 += left_out + r.1;
            continue;
        }
        merged.push(r);
    }
    let text: Vec<String> = merged
        .into_iter()
        .map(|(p, n)| match p {
            None => format!("… {n} more …"),
            Some(p) if n > 1 => format!("{p} ×{n}"),
            Some(p) => p,
        })
        .collect();
    // A path that rests on a word into a block's middle is no holder to act on.
    let uncertain = links.iter().find_map(|l| l.into);
    Some(match uncertain {
        Some(into) => format!("held by: {} (uncertain: a word points {into} bytes into a block, not at its start)", text.join(" ← ")),
        None => format!("held by: {}", text.join(" ← ")),
    })
}

/// The second holder's line under "held by" (`Group::also_held_by`): its path and how
/// many of the blocks looked at each holds.
pub fn also_held_by_text(other: &crate::report_schema::OtherHolder) -> Option<String> {
    let path = held_by_text(&other.held_by)?;
    Some(format!("also {path} ({} of the {} blocks looked at; the holder above {})", other.blocks, other.looked_at, other.held_by_blocks))
}

enum Phrase {
    Text(String),
    Elided(u64),
}

fn phrases_with_links(links: &[HeldLink]) -> Vec<Phrase> {
    // The elision marks stay where they are: fold the parts between them.
    let mut out = Vec::new();
    let mut part = Vec::new();
    for l in links {
        if l.kind == "elided" {
            out.extend(phrases(&part).into_iter().map(Phrase::Text));
            part.clear();
            out.push(Phrase::Elided(l.elided.unwrap_or(0)));
        } else {
            part.push(l.clone());
        }
    }
    out.extend(phrases(&part).into_iter().map(Phrase::Text));
    out
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

    #[test]
    fn python_containers_read_as_their_code_names_them() {
        let py = |t: Option<&str>, offset: u64| HeldLink { kind: "python_object".into(), offset, type_name: t.map(Into::into), ..Default::default() };
        let items = HeldLink { kind: "host".into(), offset: 952, api: Some("realloc".into()), size: Some(1024), ..Default::default() };
        let entry = HeldLink { key: Some("SEEN".into()), ..py(None, 232) };
        let module = HeldLink { symbol: Some("__main__".into()), ..py(Some("module"), 16) };
        let links = vec![py(Some("bytearray"), 32), items, py(Some("list"), 24), entry.clone(), py(Some("dict"), 32), module];
        assert_eq!(held_by_text(&links).unwrap(), "held by: bytearray (Python object, +32) ← list[119] ← global SEEN of module __main__");
        // A dict that is no module's: its entry by key; a short list's items in the arenas.
        let links = vec![py(None, 64), py(Some("list"), 24), entry, py(Some("dict"), 32), py(Some("Cache"), 16)];
        assert_eq!(held_by_text(&links).unwrap(), "held by: list[8] ← attribute SEEN of a Cache object");
        let links = vec![py(None, 0), py(Some("dict"), 40), py(Some("Trainer"), 16)];
        assert_eq!(held_by_text(&links).unwrap(), "held by: an attribute of a Trainer object");
        let other = crate::report_schema::OtherHolder { blocks: 2, held_by_blocks: 3, looked_at: 5, held_by: links.clone() };
        assert_eq!(also_held_by_text(&other).unwrap(), "also held by: an attribute of a Trainer object (2 of the 5 blocks looked at; the holder above 3)");
        assert_eq!(also_held_by_text(&crate::report_schema::OtherHolder::default()), None);
        let links = vec![py(None, 64), py(Some("list"), 24), HeldLink { key: Some("k".into()), ..py(None, 8) }, py(Some("dict"), 32)];
        assert_eq!(held_by_text(&links).unwrap(), "held by: list[8] ← dict[\"k\"]");
        // A running function's local (3.11+ frames), and a value on its stack.
        let local = |name: Option<&str>| HeldLink {
            kind: "python_local".into(),
            symbol: name.map(Into::into),
            function: Some("main() (replay_deque.py:16)".into()),
            ..Default::default()
        };
        let links = vec![py(Some("tuple"), 24), py(Some("collections.deque"), 16), local(Some("replay"))];
        assert_eq!(held_by_text(&links).unwrap(), "held by: tuple[0] ← collections.deque (Python object, +16) ← local replay of main() (replay_deque.py:16)");
        // A dict that a tuple holds (`args=(i, payload)`), the tuple among a 3.11+ object's
        // attribute values (a raw block whose "key" is the value before it): the dict
        // entry by key, the tuple's item, the object's attribute.
        let attribute = |t: &str| HeldLink { attribute: true, ..py(Some(t), 0) };
        let links = vec![
            py(Some("list"), 24),
            HeldLink { key: Some("v".into()), ..py(None, 56) },
            py(Some("dict"), 32),
            py(Some("tuple"), 32),
            HeldLink { key: Some("request %d done: %s".into()), ..py(None, 40) },
            attribute("LogRecord"),
        ];
        assert_eq!(held_by_text(&links).unwrap(), "held by: list ← dict[\"v\"] ← tuple[1] ← an attribute of a LogRecord object");
        let links = vec![HeldLink { key: Some("v".into()), ..py(None, 56) }, py(Some("dict"), 32), py(Some("cell"), 16)];
        assert_eq!(held_by_text(&links).unwrap(), "held by: dict[\"v\"] ← cell (Python object, +16)");
        assert_eq!(link_text(&local(None)), "a value on the stack of main() (replay_deque.py:16)");
        // A word into a block's middle makes the path uncertain.
        let links = vec![HeldLink { into: Some(224), ..py(None, 8) }, HeldLink { kind: "global".into(), symbol: Some("table".into()), ..Default::default() }];
        assert_eq!(
            held_by_text(&links).unwrap(),
            "held by: a Python object (+8) ← global table (?) (uncertain: a word points 224 bytes into a block, not at its start)"
        );
    }
}
