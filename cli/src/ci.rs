//! Output that CI systems read: GitHub Actions annotations and JUnit XML.
use crate::analyze::{Analysis, ProcessAnalysis};
use crate::model::Frame;
use crate::render::human_bytes;

/// Whether a source file is the program's own, not a system library's or an installed
/// package's: the frame a CI annotation should point at.
fn is_user_file(file: &str) -> bool {
    const SYSTEM: [&str; 4] = ["/usr/", "/lib/", "/opt/conda/", "/build/glibc"];
    const PACKAGES: [&str; 3] = ["/site-packages/", "/dist-packages/", "/.rustup/"];
    !file.starts_with('<') && !SYSTEM.iter().any(|p| file.starts_with(p)) && !PACKAGES.iter().any(|p| file.contains(p))
}

/// The first frame of `stack` in the program's own code (a file that `is_user_file`; for
/// a Python frame, not the standard library or an installed package).
pub fn first_user_frame(stack: &[Frame]) -> Option<&Frame> {
    stack.iter().find(|f| {
        let user = |file: &str| if f.python { leaktrace_common::frame_text::is_user_python_file(file) } else { is_user_file(file) };
        f.file.as_deref().is_some_and(user) && f.line.is_some()
    })
}

/// A path as the CI checkout sees it: relative to the working directory when it lies
/// under it.
fn repo_path(file: &str) -> String {
    let cwd = std::env::current_dir().ok();
    match cwd.as_deref().and_then(|d| std::path::Path::new(file).strip_prefix(d).ok()) {
        Some(rel) => rel.to_string_lossy().into_owned(),
        None => file.to_string(),
    }
}

/// A workflow command's property value: `%`, CR, LF, `:` and `,` escaped.
fn gh_property(s: &str) -> String {
    s.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A").replace(':', "%3A").replace(',', "%2C")
}

/// A workflow command's message: `%`, CR and LF escaped.
fn gh_message(s: &str) -> String {
    s.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A")
}

fn location(stack: &[Frame]) -> String {
    match first_user_frame(stack) {
        Some(f) => format!("file={},line={},", gh_property(&repo_path(f.file.as_deref().unwrap_or(""))), f.line.unwrap_or(0)),
        None => String::new(),
    }
}

fn site(stack: &[Frame]) -> String {
    let f = first_user_frame(stack).or_else(|| stack.iter().find(|f| f.function.is_some()));
    match f.and_then(|f| f.function.as_deref()) {
        Some(func) => format!(" in {func}"),
        None => String::new(),
    }
}

/// GitHub Actions annotations: an `::error` per leak group and a `::warning` per growing
/// stack, placed at the first frame in the user's code.
pub fn github(a: &Analysis) -> String {
    let mut out = String::new();
    for p in &a.processes {
        for g in &p.leaks {
            let msg = format!("{} leaked in {} allocation(s) from {}{} ({})", human_bytes(g.bytes), g.blocks, g.api, site(&g.stack), p.label);
            out.push_str(&format!("::error {}title=leaktrace: leak::{}\n", location(&g.stack), gh_message(&msg)));
        }
        for gr in &p.growth {
            let msg =
                format!("grew by {} ({}/min) from {}{} ({})", human_bytes(gr.grown_bytes), human_bytes(gr.bytes_per_minute), gr.api, site(&gr.stack), p.label);
            out.push_str(&format!("::warning {}title=leaktrace: growing::{}\n", location(&gr.stack), gh_message(&msg)));
        }
        for c in p.checks.iter().filter(|c| c.leaked_blocks() > 0) {
            let stack: &[Frame] = c.leaks.first().map_or(&[], |l| &l.stack);
            let msg = format!("check {} leaked {} in {} allocation(s){} ({})", c.label, human_bytes(c.leaked_bytes()), c.leaked_blocks(), site(stack), p.label);
            out.push_str(&format!("::error {}title={}::{}\n", location(stack), gh_property(&format!("leaktrace: {} leaked", c.label)), gh_message(&msg)));
        }
    }
    out
}

fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            // Characters XML 1.0 cannot hold.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => o.push('?'),
            c => o.push(c),
        }
    }
    o
}

fn stack_lines(stack: &[Frame]) -> String {
    stack.iter().enumerate().map(|(i, f)| crate::render::frame_line(i, f)).collect::<Vec<_>>().join("\n")
}

/// One test case per leak check the process asked for (a C++ test's
/// `leaktrace_snapshot(label)`, a pytest test), named by its label: failing when the
/// check found definite or indirect leaks.
fn check_cases(p: &ProcessAnalysis, out: &mut String) -> (usize, usize) {
    let class = xml(&format!("leaktrace.checks.{}", p.label));
    let mut failures = 0;
    for c in &p.checks {
        if c.leaked_blocks() == 0 {
            out.push_str(&format!("    <testcase classname=\"{class}\" name=\"{}\"/>\n", xml(&c.label)));
            continue;
        }
        failures += 1;
        let msg = format!(
            "{} byte(s) leaked in {} allocation(s) ({} definite, {} indirect)",
            c.leaked_bytes(),
            c.leaked_blocks(),
            c.found.definite.bytes,
            c.found.indirect.bytes
        );
        let stack = c.leaks.first().map(|l| stack_lines(&l.stack)).unwrap_or_default();
        out.push_str(&format!(
            "    <testcase classname=\"{class}\" name=\"{}\">\n      <failure type=\"leak\" message=\"{}\">{}</failure>\n    </testcase>\n",
            xml(&c.label),
            xml(&msg),
            xml(&stack)
        ));
    }
    (p.checks.len(), failures)
}

fn process_cases(p: &ProcessAnalysis, out: &mut String) -> (usize, usize) {
    let class = xml(&format!("leaktrace.{}", p.label));
    let (mut tests, mut failures) = check_cases(p, out);
    if p.leaks.is_empty() && p.growth.is_empty() {
        out.push_str(&format!("    <testcase classname=\"{class}\" name=\"no leaks\"/>\n"));
        return (tests + 1, failures);
    }
    for g in &p.leaks {
        tests += 1;
        failures += 1;
        let name = format!("{} from {}{}", human_bytes(g.bytes), g.api, site(&g.stack));
        let msg = format!("{} byte(s) leaked in {} allocation(s) from {} ({})", g.bytes, g.blocks, g.api, g.kind_label());
        let file = first_user_frame(&g.stack).and_then(|f| f.file.as_deref()).map(|f| format!(" file=\"{}\"", xml(&repo_path(f)))).unwrap_or_default();
        out.push_str(&format!(
            "    <testcase classname=\"{class}\" name=\"{}\"{file}>\n      <failure type=\"leak\" message=\"{}\">{}</failure>\n    </testcase>\n",
            xml(&name),
            xml(&msg),
            xml(&stack_lines(&g.stack))
        ));
    }
    for gr in &p.growth {
        tests += 1;
        failures += 1;
        let name = format!("growing: {} from {}{}", human_bytes(gr.grown_bytes), gr.api, site(&gr.stack));
        let msg = format!("grew by {} byte(s) over {} snapshots ({}/min)", gr.grown_bytes, gr.points, human_bytes(gr.bytes_per_minute));
        out.push_str(&format!(
            "    <testcase classname=\"{class}\" name=\"{}\">\n      <failure type=\"growth\" message=\"{}\">{}</failure>\n    </testcase>\n",
            xml(&name),
            xml(&msg),
            xml(&stack_lines(&gr.stack))
        ));
    }
    (tests, failures)
}

/// JUnit XML: one test suite per process, one failing test case per leak group and per
/// growing stack, one passing case for a process without either, and one case per leak
/// check the process asked for (failing when it leaked).
pub fn junit(a: &Analysis) -> String {
    let mut suites = String::new();
    let (mut all_tests, mut all_failures) = (0, 0);
    for p in &a.processes {
        let mut cases = String::new();
        let (tests, failures) = process_cases(p, &mut cases);
        all_tests += tests;
        all_failures += failures;
        suites.push_str(&format!("  <testsuite name=\"{}\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\">\n{cases}  </testsuite>\n", xml(&p.label)));
    }
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"leaktrace\" tests=\"{all_tests}\" failures=\"{all_failures}\" errors=\"0\">\n{suites}</testsuites>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, file: &str, line: u32) -> Frame {
        Frame { function: Some(function.into()), file: Some(file.into()), line: Some(line), ..Default::default() }
    }

    #[test]
    fn the_user_frame_skips_system_libraries_and_installed_packages() {
        let stack = vec![
            frame("malloc_impl", "/usr/src/glibc/malloc.c", 10),
            frame("forward", "/venv/lib/python3.11/site-packages/torch/nn/linear.py", 116),
            frame("train_step", "/home/me/proj/train.py", 41),
        ];
        assert_eq!(first_user_frame(&stack).unwrap().line, Some(41));
        assert!(first_user_frame(&stack[..2]).is_none());
    }

    #[test]
    fn workflow_commands_and_xml_are_escaped() {
        assert_eq!(gh_property("a,b:c%\n"), "a%2Cb%3Ac%25%0A");
        assert_eq!(gh_message("50% done\nnext"), "50%25 done%0Anext");
        assert_eq!(xml("<a href=\"x\">&'\u{1}"), "&lt;a href=&quot;x&quot;&gt;&amp;&apos;?");
    }
}
