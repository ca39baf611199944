//! "Held by": for memory that stays reachable or grows, one path of references from a
//! block out to the root that keeps it (issue 44). C holders (a global, a thread's
//! stack, a long linked list) and Python ones (a module-level list, a dict cache, an
//! attribute, an `lru_cache`), each named as the user would change it.
mod common;
use common::*;
use leaktrace_common::report_schema::HeldLink;
use serde_json::Value;
use std::process::Command;

fn links(v: &Value) -> Vec<HeldLink> {
    serde_json::from_value(v["held_by"].clone()).unwrap_or_default()
}

fn text(v: &Value) -> String {
    leaktrace_common::held::held_by_text(&links(v)).unwrap_or_default()
}

/// The listed group whose innermost frame is `function` (the fixture's allocation site).
fn group<'a>(r: &'a Value, function: &str, api: &str) -> &'a Value {
    r["leaks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["api"] == api && g["stack"][0]["function"].as_str().is_some_and(|f| f == function))
        .unwrap_or_else(|| panic!("no {api} group allocated in {function}: {:#}", r["leaks"]))
}

fn held_c(mode: &str) -> Value {
    let bin = build_fixture("held.c", &[]);
    let mut cmd = Command::new(&bin);
    cmd.arg(mode);
    let run = run_traced(cmd, &format!("held-{mode}"));
    assert!(run.output.status.success(), "{}", run.stderr());
    run.report()
}

#[test]
fn a_cache_in_a_global_list_is_held_by_its_node_and_the_global() {
    let r = held_c("global");
    let payload = group(&r, "make_payload", "malloc");
    let l = links(payload);
    assert_eq!(l.len(), 2, "{}", text(payload));
    // The node that points to it, allocated in add_session, with the payload at +16.
    assert_eq!((l[0].kind.as_ref(), l[0].offset, l[0].size), ("host", 16, Some(24)));
    assert_eq!(l[0].stack.as_ref().unwrap()[0].function.as_deref(), Some("add_session"));
    assert_eq!((l[1].kind.as_ref(), l[1].symbol.as_deref()), ("global", Some("g_sessions")));
    assert!(l[1].module.as_deref().unwrap().contains("held"), "{:?}", l[1]);
    assert!(text(payload).ends_with("← global g_sessions (") || text(payload).contains("← global g_sessions ("), "{}", text(payload));
    // The nodes themselves: the global, directly.
    let node = group(&r, "add_session", "malloc");
    assert_eq!(text(node), format!("held by: global g_sessions ({})", l[1].module.as_deref().unwrap().rsplit('/').next().unwrap()));
}

#[test]
fn a_cache_only_a_threads_stack_knows_is_held_by_that_stack() {
    let r = held_c("thread");
    let payload = group(&r, "make_payload", "malloc");
    let l = links(payload);
    let root = l.last().unwrap();
    assert_eq!(root.kind, "stack", "{}", text(payload));
    let pid = r["pid"].as_u64().unwrap() as u32;
    assert!(root.thread.is_some_and(|t| t != pid), "the worker's stack, not the main thread's: {root:?}");
    assert_eq!(l[0].stack.as_ref().unwrap()[0].function.as_deref(), Some("add_session"));
}

#[test]
fn a_long_linked_list_keeps_its_ends_and_says_how_long_it_is() {
    let r = held_c("chain");
    let payload = group(&r, "append_node", "malloc");
    let l = links(payload);
    // The newest payload hangs from the tail: 5,000 nodes from the global head.
    let elided: u64 = l.iter().filter_map(|l| l.elided).sum();
    assert!(elided > 4900, "{}", text(payload));
    assert_eq!(l.last().unwrap().symbol.as_deref(), Some("g_chain_head"));
    assert!(l.len() <= 16, "a long chain is cut: {} links", l.len());
    let t = text(payload);
    assert!(t.contains("from append_node") && t.contains("×"), "{t}");
}

#[test]
fn a_freed_block_that_still_points_to_the_memory_is_never_a_holder() {
    let r = held_c("stale");
    for g in r["leaks"].as_array().unwrap() {
        for l in links(g) {
            let site = l.stack.as_ref().and_then(|s| s.first()).and_then(|f| f.function.clone());
            assert_ne!(site.as_deref(), Some("stale_holder"), "a freed block named as a holder: {}", text(g));
        }
    }
    let payload = group(&r, "make_payload", "malloc");
    assert!(text(payload).contains("global g_sessions"), "{}", text(payload));
}

/// `holders.py MODE` under the library: the report, and every "held by" of its
/// followed stacks and listed groups.
fn held_py(mode: &str) -> Vec<String> {
    held_py_run(mode).1
}

/// `held_py`, with the run (its stderr).
fn held_py_run(mode: &str) -> (Run, Vec<String>) {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/fixtures/frameworks/holders.py")).arg(mode);
    let run = run_traced(cmd, &format!("held-py-{mode}"));
    assert!(run.output.status.success(), "{}", run.stderr());
    let r = run.report();
    let series = r["timeline"]["series"].as_array().unwrap().iter();
    let all = series.chain(r["leaks"].as_array().unwrap().iter()).map(text).filter(|t| !t.is_empty()).collect();
    (run, all)
}

fn assert_named(mode: &str, want: &str) {
    let all = held_py(mode);
    assert!(all.iter().any(|t| t.contains(want)), "{mode}: no holder names {want:?}; found:\n{}", all.join("\n"));
}

#[test]
fn python_a_module_level_list_is_named_with_its_index_and_global() {
    assert_named("list", "bytearray (Python object, +32) ← list[119] ← global SEEN of module __main__");
}

/// The same list, with raw blocks before it in the arenas whose stale words hold its
/// item array's address: still the list and its global (a full test run once named "a
/// Python object (+48)" for `kept_by_containers.py`'s list, by the arenas' layout).
#[test]
fn python_a_lists_item_array_is_named_by_the_list_whatever_stale_words_before_it_hold() {
    let (run, all) = held_py_run("stale");
    let before: u32 = run.stderr().split("raw blocks before the list: ").nth(1).and_then(|t| t.split_whitespace().next()?.parse().ok()).unwrap_or(0);
    assert!(before > 0, "the fixture placed no raw block before the list: {}", run.stderr());
    let want = "bytearray (Python object, +32) ← list[119] ← global SEEN of module __main__";
    assert!(all.iter().any(|t| t.contains(want)), "no holder names {want:?}; found:\n{}", all.join("\n"));
    // The fixture's lines only: a stale word that pointed at an item array freed by the
    // list's last growth (the words are rewritten right after) may point at anything.
    let bytearrays: Vec<&String> = all.iter().filter(|t| t.contains("bytearray (Python object, +32) ←")).collect();
    assert!(!bytearrays.iter().any(|t| t.contains("list_resize")), "a stale word named: {}", all.join("\n"));
}

#[test]
fn python_a_dict_cache_keyed_per_step_is_named_by_key_and_global() {
    assert_named("dict", "dict[\"step119\"] ← global CACHE of module __main__");
}

#[test]
fn python_an_object_attribute_names_the_class_and_the_global() {
    // 3.11+: "an attribute of a Trainer object"; 3.13 keeps the values in the object.
    let all = held_py("attr");
    assert!(
        all.iter().any(|t| t.contains("list[119] ←") && t.contains("Trainer") && t.contains("global TRAINER of module __main__")),
        "attr: {}",
        all.join("\n")
    );
}

#[test]
fn python_an_lru_cache_is_named_by_the_cached_function() {
    assert_named("lru", "functools._lru_cache_wrapper (Python object, +72) ← global features of module __main__");
}

/// One line's blocks held by two lists, two thirds by one and a third by the other:
/// the holder most of the blocks looked at have, and the second one with its share.
#[test]
fn python_blocks_of_one_line_held_by_two_lists_name_both_with_their_share() {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/fixtures/frameworks/holders.py")).arg("split");
    let run = run_traced(cmd, "held-py-split");
    assert!(run.output.status.success(), "{}", run.stderr());
    let r = run.report();
    let series = r["timeline"]["series"].as_array().unwrap().iter();
    let held: Vec<(String, String)> = series
        .chain(r["leaks"].as_array().unwrap().iter())
        .filter(|v| !links(v).is_empty())
        .map(|v| {
            let also: Option<leaktrace_common::report_schema::OtherHolder> = serde_json::from_value(v["also_held_by"].clone()).ok();
            (text(v), also.and_then(|o| leaktrace_common::held::also_held_by_text(&o)).unwrap_or_default())
        })
        .collect();
    let shown = held.iter().map(|(h, a)| format!("{h}\n{a}")).collect::<Vec<_>>().join("\n");
    let both = held.iter().find(|(h, a)| h.ends_with("global SEEN of module __main__") && a.contains("global LATER of module __main__"));
    let (_, also) = both.unwrap_or_else(|| panic!("no holder with its second: {shown}"));
    // "also held by: … (K of the N blocks looked at; the holder above M)", K < M, K + M <= N.
    let numbers: Vec<u32> = also.rsplit('(').next().unwrap().split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect();
    let [k, n, m] = numbers[..] else { panic!("{also}") };
    assert!(k >= 1 && k <= m && k + m <= n, "{also}");
}
