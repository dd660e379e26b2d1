//! Maintenance windows: when steps that disrupt healthy GPUs may run.

use gpuhealth_api::policy::{MaintenanceWindow, Weekday};
use k8s_openapi::jiff::{
    Timestamp, Zoned,
    civil::{Date, Time},
    tz::TimeZone,
};

use crate::problem::Problem;

/// Whether `now` falls in one of `windows`; no windows means always. An
/// unreadable window (an unknown time zone) is never open: a mistake in the
/// policy holds disruption back rather than letting it through.
pub fn is_open(windows: &[MaintenanceWindow], now: Timestamp) -> Result<bool, String> {
    if windows.is_empty() {
        return Ok(true);
    }
    for w in windows {
        let (tz, start, end) = parse(w)?;
        let today = now.to_zoned(tz.clone()).date();
        for day in [today.yesterday(), Ok(today)].into_iter().flatten() {
            if let Some((from, until)) = occurrence(w, &tz, day, start, end)
                && from.timestamp() <= now
                && now < until.timestamp()
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// When the next window opens after `now`, within a week.
pub fn next_opening(windows: &[MaintenanceWindow], now: Timestamp) -> Option<Timestamp> {
    let mut next: Option<Timestamp> = None;
    for w in windows {
        let Ok((tz, start, end)) = parse(w) else {
            continue;
        };
        let mut day = now.to_zoned(tz.clone()).date();
        for _ in 0..8 {
            if let Some((from, _)) = occurrence(w, &tz, day, start, end)
                && from.timestamp() > now
            {
                next = Some(next.map_or(from.timestamp(), |n| n.min(from.timestamp())));
                break;
            }
            let Ok(tomorrow) = day.tomorrow() else {
                break;
            };
            day = tomorrow;
        }
    }
    next
}

fn parse(w: &MaintenanceWindow) -> Result<(TimeZone, Time, Time), String> {
    let tz = TimeZone::get(&w.time_zone)
        .map_err(|e| format!("maintenance window time zone {:?}: {e}", w.time_zone))?;
    let time = |s: &str| {
        Time::strptime("%H:%M", s).map_err(|e| format!("maintenance window time {s:?}: {e}"))
    };
    Ok((tz, time(&w.start)?, time(&w.end)?))
}

/// Every field of `windows` that cannot be read, by its path in the policy
/// (`spec.maintenanceWindows[1].timeZone`). Such a window never opens, nor
/// does any listed after it ([`is_open`] stops there), so each is worth
/// saying before a node waits on it.
pub fn problems(windows: &[MaintenanceWindow]) -> Vec<Problem> {
    const SHUT: &str = "so this window never opens, nor does any listed after it";
    let mut out = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        let field = |name: &str| format!("spec.maintenanceWindows[{i}].{name}");
        if TimeZone::get(&w.time_zone).is_err() {
            out.push(Problem::new(
                field("timeZone"),
                format!("unknown time zone {:?}, {SHUT}", w.time_zone),
            ));
        }
        for (name, value) in [("start", &w.start), ("end", &w.end)] {
            if Time::strptime("%H:%M", value).is_err() {
                out.push(Problem::new(
                    field(name),
                    format!("{value:?} is not a 24-hour HH:MM time, {SHUT}"),
                ));
            }
        }
    }
    out
}

/// The window starting on `day`, if it starts on that weekday.
fn occurrence(
    w: &MaintenanceWindow,
    tz: &TimeZone,
    day: Date,
    start: Time,
    end: Time,
) -> Option<(Zoned, Zoned)> {
    if !w.days.is_empty() && !w.days.contains(&weekday(day)) {
        return None;
    }
    let from = day.to_datetime(start).to_zoned(tz.clone()).ok()?;
    let end_day = if end <= start {
        day.tomorrow().ok()?
    } else {
        day
    };
    let until = end_day.to_datetime(end).to_zoned(tz.clone()).ok()?;
    Some((from, until))
}

fn weekday(day: Date) -> Weekday {
    use k8s_openapi::jiff::civil::Weekday as W;
    match day.weekday() {
        W::Monday => Weekday::Mon,
        W::Tuesday => Weekday::Tue,
        W::Wednesday => Weekday::Wed,
        W::Thursday => Weekday::Thu,
        W::Friday => Weekday::Fri,
        W::Saturday => Weekday::Sat,
        W::Sunday => Weekday::Sun,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(days: &[Weekday], start: &str, end: &str, tz: &str) -> MaintenanceWindow {
        MaintenanceWindow {
            days: days.to_vec(),
            start: start.into(),
            end: end.into(),
            time_zone: tz.into(),
        }
    }

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    #[test]
    fn a_night_window_runs_past_midnight_in_its_time_zone() {
        // Weekdays 22:00-06:00 in Berlin (UTC+2 in summer).
        let w = [window(
            &[
                Weekday::Mon,
                Weekday::Tue,
                Weekday::Wed,
                Weekday::Thu,
                Weekday::Fri,
            ],
            "22:00",
            "06:00",
            "Europe/Berlin",
        )];
        // Friday 2026-05-29 23:00 Berlin = 21:00Z: open.
        assert_eq!(is_open(&w, t("2026-05-29T21:00:00Z")), Ok(true));
        // Saturday 05:00 Berlin, the tail of Friday's window: open.
        assert_eq!(is_open(&w, t("2026-05-30T03:00:00Z")), Ok(true));
        // Saturday 23:00 Berlin: no window starts on Saturday.
        assert_eq!(is_open(&w, t("2026-05-30T21:00:00Z")), Ok(false));
        // Friday 12:00 Berlin: closed; it opens at 22:00 Berlin.
        assert_eq!(is_open(&w, t("2026-05-29T10:00:00Z")), Ok(false));
        assert_eq!(
            next_opening(&w, t("2026-05-29T10:00:00Z")),
            Some(t("2026-05-29T20:00:00Z"))
        );
        // Saturday noon: the next one is Monday night.
        assert_eq!(
            next_opening(&w, t("2026-05-30T10:00:00Z")),
            Some(t("2026-06-01T20:00:00Z"))
        );
    }

    #[test]
    fn no_windows_is_always_and_a_bad_zone_is_never() {
        assert_eq!(is_open(&[], t("2026-05-29T10:00:00Z")), Ok(true));
        let bad = [window(&[], "00:00", "23:59", "Mars/Olympus")];
        assert!(is_open(&bad, t("2026-05-29T10:00:00Z")).is_err());
        assert_eq!(next_opening(&bad, t("2026-05-29T10:00:00Z")), None);
    }

    #[test]
    fn each_field_that_cannot_be_read_is_named() {
        let windows = [
            window(&[Weekday::Sat], "22:00", "06:00", "Europe/Berlin"),
            window(&[], "00:00", "23:59", "Mars/Base"),
            window(&[], "25:00", "7h", "UTC"),
        ];
        let found: Vec<String> = problems(&windows).iter().map(|p| p.to_string()).collect();
        assert_eq!(
            found,
            [
                "spec.maintenanceWindows[1].timeZone: unknown time zone \"Mars/Base\", so this window never opens, nor does any listed after it",
                "spec.maintenanceWindows[2].start: \"25:00\" is not a 24-hour HH:MM time, so this window never opens, nor does any listed after it",
                "spec.maintenanceWindows[2].end: \"7h\" is not a 24-hour HH:MM time, so this window never opens, nor does any listed after it",
            ]
        );
        // What is named is what keeps windows shut: the one before it still
        // opens (Saturday 23:00 in Berlin); when it is shut (Friday), the
        // unreadable one is reached and none opens.
        assert_eq!(is_open(&windows, t("2026-05-30T21:00:00Z")), Ok(true));
        assert!(is_open(&windows, t("2026-05-29T21:00:00Z")).is_err());
        assert!(problems(&windows[..1]).is_empty());
        assert!(problems(&[]).is_empty());
        // Zones the bundled database knows, including the default.
        for zone in ["UTC", "America/New_York", "Asia/Kolkata", "Etc/GMT+5"] {
            assert!(
                problems(&[window(&[], "01:00", "02:00", zone)]).is_empty(),
                "{zone}"
            );
        }
    }
}
