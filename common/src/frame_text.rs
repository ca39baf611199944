//! One stack frame as LeakSanitizer prints it:
//! `    #3 0x55d0c0a0115a in train_step /src/x.c:28 (/bin/x+0x115a)`.

pub struct FrameFields<'a> {
    pub ip: &'a str,
    pub function: Option<&'a str>,
    pub file: Option<&'a str>,
    pub line: Option<u32>,
    pub module: Option<&'a str>,
    pub offset: Option<u64>,
    pub inlined: bool,
}

pub fn frame_line(index: usize, f: &FrameFields) -> String {
    let mut s = format!("    #{index} {}", f.ip);
    if let Some(func) = f.function {
        s.push_str(" in ");
        s.push_str(func);
    }
    if let Some(file) = f.file {
        s.push(' ');
        s.push_str(file);
        if let Some(line) = f.line {
            s.push_str(&format!(":{line}"));
        }
    }
    match (f.module, f.offset) {
        (Some(m), Some(off)) => s.push_str(&format!(" ({m}+{off:#x})")),
        (Some(m), None) => s.push_str(&format!(" ({m})")),
        _ => {}
    }
    if f.inlined {
        s.push_str(" [inlined]");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsan_shape() {
        let f = FrameFields {
            ip: "0x1234",
            function: Some("leak_here"),
            file: Some("/src/x.c"),
            line: Some(12),
            module: Some("/bin/x"),
            offset: Some(0x234),
            inlined: false,
        };
        assert_eq!(frame_line(0, &f), "    #0 0x1234 in leak_here /src/x.c:12 (/bin/x+0x234)");
        let bare = FrameFields { ip: "0x9", function: None, file: None, line: None, module: None, offset: None, inlined: true };
        assert_eq!(frame_line(7, &bare), "    #7 0x9 [inlined]");
    }
}
