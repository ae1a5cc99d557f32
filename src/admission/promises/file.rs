//! The promises file (`PROMISES_FILE`): one line per promise, appended as they are made
//! and rewritten when compacted, so that a restarted instance keeps its predecessor's 202s.

use super::*;

impl Promises {
    /// Promises kept in memory, and in `file` too if given: those it holds (written by
    /// this instance's previous life) are kept again. An error when the file cannot be
    /// read, written or locked (another instance uses it).
    pub fn open(file: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = file else {
            return Ok(Self::default());
        };
        let what = |doing: &str| format!("PROMISES_FILE {}: {doing}", path.display());
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", what("cannot open")))?;
        file.try_lock().map_err(|_| {
            anyhow::anyhow!("{}", what("another instance keeps its promises there"))
        })?;
        let mut kept: HashMap<Shard, VecDeque<Promise>> = HashMap::new();
        let mut unreadable = 0;
        for line in std::io::BufReader::new(&file).lines() {
            let line = line.map_err(|e| anyhow::anyhow!("{}: {e}", what("cannot read")))?;
            match Promise::parse(&line) {
                Some((shard, p)) => kept.entry(shard).or_default().push_back(p),
                None => unreadable += 1,
            }
        }
        if unreadable > 0 {
            // (The last line of a life cut short may be partial.)
            tracing::warn!(unreadable, "lines of the promises file skipped");
        }
        for queue in kept.values_mut() {
            queue.make_contiguous().sort_by_key(|p| p.entry);
        }
        let held: usize = kept.values().map(VecDeque::len).sum();
        if held > 0 {
            tracing::warn!(
                promises = held,
                "202s of this instance's previous life not known written: kept again"
            );
        }
        let promises = Self {
            keeper: keeper_on_file(path)?,
            kept: Mutex::new(kept),
            log: Some(Mutex::new(Log {
                path: path.to_path_buf(),
                file,
                lines: usize::MAX,
                failing: false,
            })),
            ..Self::default()
        };
        promises.compact()?;
        Ok(promises)
    }

    /// Rewrites the promises file with only the promises kept, once it holds many more
    /// lines than that (and at start).
    pub(crate) fn compact(&self) -> anyhow::Result<()> {
        self.rewrite(false)
    }

    /// Rewrites the promises file with only the promises kept: when `force`, at once
    /// (promises settled, broken or moved by [`Self::keep`]: a restart must not judge
    /// them again from their old lines), else once it holds many more lines than that.
    pub(super) fn rewrite(&self, force: bool) -> anyhow::Result<()> {
        let Some(log) = &self.log else {
            return Ok(());
        };
        // (The promises' lock first, as `record` takes them: none is recorded meanwhile.)
        let kept = self.lock();
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = kept.values().map(VecDeque::len).sum();
        if !force && log.lines != usize::MAX && log.lines <= 2 * held + 4096 {
            return Ok(());
        }
        let fresh = log.path.with_extension("new");
        let write = || -> std::io::Result<File> {
            let mut out = BufWriter::new(File::create(&fresh)?);
            for (shard, queue) in kept.iter() {
                for p in queue {
                    out.write_all(p.line(*shard).as_bytes())?;
                }
            }
            let out = out.into_inner().map_err(|e| e.into_error())?;
            // Locked before it takes the old file's place: no instance starting now
            // finds it unlocked.
            out.try_lock().map_err(std::io::Error::other)?;
            std::fs::rename(&fresh, &log.path)?;
            Ok(out)
        };
        let file = write().map_err(|e| {
            anyhow::anyhow!("PROMISES_FILE {}: cannot rewrite: {e}", log.path.display())
        })?;
        // (Opened for writing; appends go to its end, which is where it stands.)
        log.file = file;
        log.lines = held;
        Ok(())
    }
}

impl Promise {
    /// Its line in the promises file.
    pub(super) fn line(&self, shard: Shard) -> String {
        format!(
            "{} {} {} {} {} {} {}-{}\n",
            shard.0,
            self.order_id.get(),
            self.user_id.get(),
            self.segment.voucher_id.get(),
            self.segment.segment,
            self.segment.segments,
            self.entry.0,
            self.entry.1
        )
    }

    /// A line of the promises file: `None` if it is not one.
    pub(super) fn parse(line: &str) -> Option<(Shard, Self)> {
        let mut f = line.split(' ');
        let mut next = || f.next();
        let shard = Shard(next()?.parse().ok()?);
        let order_id = next()?.parse().ok()?;
        let user_id = next()?.parse().ok()?;
        let voucher_id = next()?.parse().ok()?;
        let (segment, segments) = (next()?.parse().ok()?, next()?.parse().ok()?);
        let entry = stream::parse_entry_id(next()?)?;
        if next().is_some() {
            return None;
        }
        let promise = Self {
            order_id,
            user_id,
            segment: SaleSegment::new(voucher_id, segment, segments),
            entry,
            tries: 0,
        };
        Some((shard, promise))
    }
}

impl Log {
    /// Appends `lines` (`count` promises); a failure is logged once.
    pub(super) fn append(&mut self, lines: &[u8], count: usize) {
        match self.file.write_all(lines) {
            Ok(()) => {
                self.lines = self.lines.saturating_add(count);
                self.failing = false;
            }
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::error!(path = %self.path.display(), error = %e,
                    "promises file not written: a restart of this instance would lose its 202s");
            }
            Err(_) => {}
        }
    }
}

/// The keeper's name of an instance keeping its promises in `path`: drawn once and kept
/// beside it (`<path>.keeper`), the same in every life of the instance (the file is
/// locked, so one at a time), which then holds no new term back in the name of its
/// previous life.
fn keeper_on_file(path: &Path) -> anyhow::Result<String> {
    let beside = path.with_extension("keeper");
    let what = |e: std::io::Error| anyhow::anyhow!("{}: {e}", beside.display());
    match std::fs::read_to_string(&beside) {
        Ok(name) if !name.trim().is_empty() => return Ok(name.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(what(e)),
    }
    let name = uuid::Uuid::new_v4().to_string();
    std::fs::write(&beside, &name).map_err(what)?;
    Ok(name)
}
