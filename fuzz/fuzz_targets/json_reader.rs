//! The JSON tree reader on arbitrary text: never a panic, and what it reads writes back to
//! text it reads again (not always the same variant: `-0` reads as a negative-literal
//! integer and is written as `0`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use lowbit_io::json::Json;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(v) = Json::parse(text) {
        Json::parse(&v.to_string()).expect("compact");
        Json::parse(&v.to_text()).expect("diffable");
    }
});
