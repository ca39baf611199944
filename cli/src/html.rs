//! One self-contained HTML file: live memory over time from the periodic snapshots
//! (inline SVG, one chart per process: the total and its largest stacks), stacks that
//! grew, and a sortable table of every leak group with its stack. No external assets.
use crate::analyze::Analysis;
use crate::model::{Frame, Report};
use crate::render::human_bytes;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn frame_label(f: &Frame) -> String {
    let mut s = f.function.as_deref().map(str::to_string).unwrap_or_else(|| match (&f.module, f.offset) {
        (Some(m), Some(o)) => format!("{m}+{o:#x}"),
        _ => format!("{:#x}", f.ip),
    });
    if let (Some(file), Some(line)) = (&f.file, f.line) {
        s.push_str(&format!(" ({file}:{line})"));
    }
    s
}

/// The function a stack is named by: that of its first frame in the user's own code (a
/// Python line, or a source file of the program), else the innermost named one.
fn top_function(stack: &[Frame]) -> String {
    crate::ci::first_user_frame(stack)
        .and_then(|f| f.function.as_deref())
        .or_else(|| stack.iter().find_map(|f| f.function.as_deref()))
        .unwrap_or("(no symbols)")
        .to_string()
}

/// A leak row's name: the first frame in the user's own code with its file and line.
fn row_site(stack: &[Frame]) -> String {
    crate::ci::first_user_frame(stack).map(frame_label).unwrap_or_else(|| top_function(stack))
}

const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// The points a chart draws: the report's, after the process's start at 0 bytes when
/// they are too few to draw (a program of a moment has only its exit point); and
/// whether that start point was put first. A program that starts and exits within the
/// same millisecond gets its start point too (a chart 0.0 s wide), so whether a page has
/// a chart does not depend on how fast the machine ran it.
fn chart_points(report: &Report) -> (Vec<crate::model::Point>, bool) {
    let points = &report.timeline.points;
    let first = points.first().map(|p| p.unix_ms).unwrap_or(report.written_unix_ms);
    if points.len() >= 2 || report.started_unix_ms == 0 || report.started_unix_ms > first {
        return (points.clone(), false);
    }
    let mut with_start = vec![crate::model::Point { unix_ms: report.started_unix_ms, live_bytes: 0, live_blocks: 0, memory: None }];
    with_start.extend(points.iter().cloned());
    if points.is_empty() {
        let h = &report.summary.host;
        with_start.push(crate::model::Point { unix_ms: report.written_unix_ms, live_bytes: h.live_bytes, live_blocks: h.live_blocks, memory: None });
    }
    (with_start, true)
}

/// An SVG line chart: total live bytes and up to 7 largest followed stacks.
fn chart(report: &Report, idx: usize) -> String {
    let (points, from_start) = chart_points(report);
    let points = &points;
    if points.len() < 2 {
        return format!("<p class=\"nochart\" id=\"chart-{idx}\">One snapshot only: run with --interval-ms to chart memory over time.</p>");
    }
    let (w, h, pad) = (W, H, PAD);
    let t0 = points[0].unix_ms as f64;
    let t1 = points[points.len() - 1].unix_ms as f64;
    let span = (t1 - t0).max(1.0);
    let max = points.iter().map(|p| p.live_bytes).max().unwrap_or(1).max(1) as f64;
    let xy = |i: usize, v: u64| -> String {
        let x = pad + (points[i].unix_ms as f64 - t0) / span * (w - 2.0 * pad);
        let y = h - pad - (v as f64 / max) * (h - 2.0 * pad);
        format!("{x:.1},{y:.1}")
    };
    let mut lines = Vec::new();
    let total: Vec<String> = points.iter().enumerate().map(|(i, p)| xy(i, p.live_bytes)).collect();
    lines.push(format!(
        "<polyline class=\"series total\" data-name=\"total\" fill=\"none\" stroke=\"{}\" stroke-width=\"2.5\" points=\"{}\"/>",
        COLORS[0],
        total.join(" ")
    ));
    let skip = usize::from(from_start);
    let mut series: Vec<&crate::model::Series> = report.timeline.series.iter().filter(|s| s.bytes.len() + skip == points.len()).collect();
    series.sort_by_key(|s| std::cmp::Reverse(s.bytes.iter().copied().max().unwrap_or(0)));
    let mut legend = vec![format!("<li><span style=\"background:{}\"></span>total live bytes</li>", COLORS[0])];
    for (k, s) in series.iter().take(COLORS.len() - 1).enumerate() {
        let color = COLORS[k + 1];
        let pts: Vec<String> = std::iter::repeat_n(&0, skip).chain(&s.bytes).enumerate().map(|(i, v)| xy(i, *v)).collect();
        let name = top_function(report.series_stack(s));
        lines.push(format!(
            "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
            esc(&name),
            pts.join(" ")
        ));
        legend.push(format!("<li><span style=\"background:{color}\"></span>{} ({})</li>", esc(&name), s.api));
    }
    let axes = format!("<line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{}\" stroke=\"#999\"/>{}", H - PAD, lines.join(""));
    svg_chart(&format!("chart-{idx}"), "chart", "live memory over time", &axes, max as u64, span, &legend)
}

/// The chart area's size and margin (px).
const W: f64 = 760.0;
const H: f64 = 260.0;
const PAD: f64 = 40.0;

/// An SVG chart of the page's size around `body`: the time axis, the largest value at
/// the top, the run's seconds at the ends, and the legend below.
fn svg_chart(id: &str, class: &str, label: &str, body: &str, max: u64, span_ms: f64, legend: &[String]) -> String {
    format!(
        "<svg id=\"{id}\" class=\"{class}\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" role=\"img\" aria-label=\"{label}\">\
         <line x1=\"{PAD}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"#999\"/>{body}\
         <text x=\"{PAD}\" y=\"{t}\" font-size=\"11\">{maxl}</text><text x=\"{PAD}\" y=\"{bl}\" font-size=\"11\">0 s</text>\
         <text x=\"{r}\" y=\"{bl}\" font-size=\"11\" text-anchor=\"end\">{secs:.1} s</text></svg><ul class=\"legend\">{}</ul>",
        legend.join(""),
        b = H - PAD,
        r = W - PAD,
        t = PAD - 8.0,
        bl = H - PAD + 16.0,
        maxl = human_bytes(max),
        secs = span_ms / 1000.0,
    )
}

/// Colors of the memory's parts, in `Memory::parts` order.
/// One colour per part of `Memory::parts`, in its order (a part added there needs one
/// here: the count is checked when this builds).
const PART_COLORS: [&str; PARTS] =
    ["#1f77b4", "#aec7e8", "#c7c7c7", "#2ca02c", "#98df8a", "#c5b0d5", "#ff7f0e", "#9467bd", "#8c564b", "#dbdb8d", "#d62728", "#f7b6d2"];
const PARTS: usize = leaktrace_common::memory::Memory::PARTS;

/// An SVG chart of the process's memory by part over time, the parts stacked (the
/// top of the stack is RSS, or more where a part is held but not resident).
fn memory_chart(points: &[(u64, leaktrace_common::memory::Memory)], idx: usize) -> String {
    if points.len() < 2 {
        return String::new();
    }
    let (w, h, pad) = (W, H, PAD);
    let t0 = points[0].0 as f64;
    let span = (points[points.len() - 1].0 as f64 - t0).max(1.0);
    let stacked: Vec<Vec<u64>> = points
        .iter()
        .map(|(_, m)| {
            m.parts()
                .iter()
                .scan(0u64, |sum, p| {
                    *sum += p.1;
                    Some(*sum)
                })
                .collect()
        })
        .collect();
    let max = stacked.iter().filter_map(|s| s.last().copied()).chain(points.iter().map(|p| p.1.rss)).max().unwrap_or(1).max(1) as f64;
    let x = |i: usize| pad + (points[i].0 as f64 - t0) / span * (w - 2.0 * pad);
    let y = |v: u64| h - pad - (v as f64 / max) * (h - 2.0 * pad);
    let names = points[0].1.parts().map(|p| p.0);
    let mut shapes = Vec::new();
    let mut legend = Vec::new();
    for (k, name) in names.iter().enumerate() {
        if stacked.iter().all(|s| s[k] == if k == 0 { 0 } else { s[k - 1] }) {
            continue;
        }
        let top: Vec<String> = (0..points.len()).map(|i| format!("{:.1},{:.1}", x(i), y(stacked[i][k]))).collect();
        let bottom: Vec<String> = (0..points.len()).rev().map(|i| format!("{:.1},{:.1}", x(i), y(if k == 0 { 0 } else { stacked[i][k - 1] }))).collect();
        shapes.push(format!("<polygon class=\"part\" data-name=\"{name}\" fill=\"{}\" points=\"{} {}\"/>", PART_COLORS[k], top.join(" "), bottom.join(" ")));
        legend.push(format!("<li><span style=\"background:{}\"></span>{}</li>", PART_COLORS[k], crate::render::part_label(name)));
    }
    let rss: Vec<String> = (0..points.len()).map(|i| format!("{:.1},{:.1}", x(i), y(points[i].1.rss))).collect();
    legend.push("<li><span style=\"background:#000\"></span>RSS</li>".into());
    let body = format!("{}<polyline class=\"rss\" fill=\"none\" stroke=\"#000\" stroke-width=\"1.5\" points=\"{}\"/>", shapes.join(""), rss.join(" "));
    svg_chart(&format!("memory-{idx}"), "chart memory", "memory by part over time", &body, max as u64, span, &legend)
}

fn stack_html(stack: &[Frame]) -> String {
    let shown = crate::render::shown_frames(stack);
    let items: Vec<String> = shown
        .iter()
        .map(|&k| &stack[k])
        .map(|f| {
            let module = f.module.as_deref().map(|m| format!(" <span class=\"mod\">{}</span>", esc(m))).unwrap_or_default();
            format!("<li><code>{}</code>{module}</li>", esc(&frame_label(f)))
        })
        .collect();
    format!("<ol class=\"stack\">{}</ol>", items.join(""))
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}\
table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}\
th{cursor:pointer;background:#f4f4f4;user-select:none}th.num,td.num{text-align:right}th[data-dir=asc]::after{content:' \\25B2'}\
th[data-dir=desc]::after{content:' \\25BC'}ol.stack{margin:4px 0 4px 18px;padding:0;font-size:12px}.mod{color:#888}\
.legend{list-style:none;padding:0;font-size:12px}.legend li{display:inline-block;margin-right:14px}\
.legend span{display:inline-block;width:10px;height:10px;margin-right:4px}summary{cursor:pointer}\
.ranks{overflow-x:auto}.ranks table{width:auto}.ranks td{text-align:right;white-space:nowrap}td.worst{background:#fde2e1;font-weight:bold}";

/// Sorting by column; `#sort=<column>-<asc|desc>` in the URL sorts on load (used by tests).
const SCRIPT: &str = "function sortBy(th,dir){const t=th.closest('table'),b=t.tBodies[0],i=th.cellIndex,num=th.classList.contains('num');\
const rows=[...b.rows];rows.sort((x,y)=>{const a=x.cells[i].dataset.v??x.cells[i].textContent,c=y.cells[i].dataset.v??y.cells[i].textContent;\
const r=num?(Number(a)-Number(c)):a.localeCompare(c);return dir==='asc'?r:-r});rows.forEach(r=>b.appendChild(r));\
t.querySelectorAll('th').forEach(h=>h.removeAttribute('data-dir'));th.dataset.dir=dir}\
document.querySelectorAll('#leaks th').forEach(th=>th.addEventListener('click',()=>sortBy(th,th.dataset.dir==='desc'?'asc':'desc')));\
const m=location.hash.match(/sort=(\\w+)-(asc|desc)/);if(m){const th=document.querySelector('#leaks th[data-col='+m[1]+']');if(th)sortBy(th,m[2])}";

/// "held by", each link a summary that opens its allocation stack (blocks) or a plain
/// item (roots); empty without a path.
fn held_html(links: &[leaktrace_common::report_schema::HeldLink], also: Option<&leaktrace_common::report_schema::OtherHolder>) -> String {
    if links.is_empty() {
        return String::new();
    }
    let also = also.and_then(|o| {
        let text = leaktrace_common::held::also_held_by_text(o)?;
        Some(format!("<div class=\"held\">{}</div>", esc(&text)))
    });
    let items: Vec<String> = links
        .iter()
        .map(|l| {
            let text = esc(&leaktrace_common::held::link_text(l));
            match l.stack.as_deref() {
                Some(stack) if !stack.is_empty() => format!("<li><details><summary>{text}</summary>{}</details></li>", stack_html(stack)),
                _ => format!("<li>{text}</li>"),
            }
        })
        .collect();
    format!("<div class=\"held\">held by (from the block out to its root):<ol class=\"held\">{}</ol></div>{}", items.join(""), also.unwrap_or_default())
}

pub fn page(a: &Analysis, reports: &[Report]) -> String {
    let mut body =
        format!("<h1>leaktrace: {} leaked in {} allocation(s) across {} process(es)</h1>", human_bytes(a.leaked_bytes), a.leaked_blocks, a.processes.len());
    if let Some(v) = &a.ranks {
        body.push_str(&crate::ranks::html(v, esc));
    }
    body.push_str("<h2>Live memory over time</h2>");
    for (i, (p, r)) in a.processes.iter().zip(reports).enumerate() {
        body.push_str(&format!("<h3>{}</h3>{}", esc(&p.label), chart(r, i)));
    }
    let with_memory: Vec<(usize, &crate::analyze::ProcessAnalysis)> =
        a.processes.iter().enumerate().filter(|(_, p)| p.memory_points.len() >= 2 || !p.memory_findings.is_empty()).collect();
    if !with_memory.is_empty() {
        body.push_str("<h2>Memory by part</h2>");
        for (i, p) in with_memory {
            body.push_str(&format!("<h3>{}</h3>", esc(&p.label)));
            if let Some(m) = &p.memory {
                body.push_str(&format!("<p>{}</p>", esc(&crate::render::memory_line(m))));
            }
            body.push_str(&memory_chart(&p.memory_points, i));
            if !p.memory_findings.is_empty() {
                body.push_str("<ul class=\"findings\">");
                for f in &p.memory_findings {
                    body.push_str(&format!(
                        "<li><b>{}</b>: {}. <i>What to do:</i> {}</li>",
                        esc(crate::render::part_label(f.part)),
                        esc(&f.what),
                        esc(&f.remedy)
                    ));
                }
                body.push_str("</ul>");
            }
        }
    }
    let growth: Vec<_> = a.processes.iter().flat_map(|p| p.growth.iter().map(move |g| (p, g))).collect();
    body.push_str(&format!("<h2>Growing during the run ({})</h2>", growth.len()));
    if growth.is_empty() {
        body.push_str("<p>No stack grew steadily across the snapshots.</p>");
    } else {
        body.push_str("<ul id=\"growth\">");
        for (p, g) in growth {
            body.push_str(&format!(
                "<li><details><summary>{} — grew {} over {} snapshots ({}/min), {}</summary>{}</details>{}</li>",
                esc(&top_function(&g.stack)),
                human_bytes(g.grown_bytes),
                g.points,
                human_bytes(g.bytes_per_minute),
                esc(&p.label),
                stack_html(&g.stack),
                held_html(&g.held_by, g.also_held_by.as_ref())
            ));
        }
        body.push_str("</ul>");
    }
    body.push_str(
        "<h2>Leak groups</h2><table id=\"leaks\"><thead><tr><th data-col=\"process\">process</th>\
         <th class=\"num\" data-col=\"bytes\">bytes</th><th class=\"num\" data-col=\"blocks\">blocks</th>\
         <th data-col=\"api\">api</th><th data-col=\"site\">allocated at</th></tr></thead><tbody>",
    );
    for p in &a.processes {
        for g in &p.leaks {
            body.push_str(&format!(
                "<tr><td>{}</td><td class=\"num\" data-v=\"{}\">{}</td><td class=\"num\" data-v=\"{}\">{}</td><td>{}</td>\
                 <td><details><summary>{}</summary>{}</details>{}</td></tr>",
                esc(&p.label),
                g.bytes,
                g.bytes,
                g.blocks,
                g.blocks,
                esc(&g.api),
                esc(&row_site(&g.stack)),
                stack_html(&g.stack),
                held_html(&g.held_by, g.also_held_by.as_ref())
            ));
        }
    }
    body.push_str("</tbody></table>");
    format!(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>leaktrace report</title><style>{STYLE}</style></head>\
         <body>{body}<script>{SCRIPT}</script></body></html>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Point;

    fn exit_report(started: u64, at: u64) -> Report {
        let mut r = Report { reason: "exit".into(), started_unix_ms: started, written_unix_ms: at, ..Default::default() };
        r.timeline.points = vec![Point { unix_ms: at, live_bytes: 2_176, live_blocks: 109, memory: None }];
        r
    }

    #[test]
    fn a_program_of_a_moment_is_charted_from_its_start_whatever_its_milliseconds() {
        for (started, at) in [(1_000, 1_002), (1_000, 1_001), (1_000, 1_000)] {
            let (points, from_start) = chart_points(&exit_report(started, at));
            assert!(from_start, "{started} {at}");
            assert_eq!(points.iter().map(|p| (p.unix_ms, p.live_bytes)).collect::<Vec<_>>(), vec![(started, 0), (at, 2_176)]);
            let svg = chart(&exit_report(started, at), 0);
            assert!(svg.contains("<polyline class=\"series total\"") && !svg.contains("nochart"), "{svg}");
        }
    }

    #[test]
    fn a_start_after_the_first_point_or_unknown_is_not_invented() {
        for started in [0, 1_003] {
            let (points, from_start) = chart_points(&exit_report(started, 1_002));
            assert!(!from_start);
            assert_eq!(points.len(), 1);
            assert!(chart(&exit_report(started, 1_002), 0).contains("nochart"));
        }
    }
}
