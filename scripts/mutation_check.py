#!/usr/bin/env python3
"""Mutation checks: does any test fail when one safety check of a source file is removed?

For each `if (COND) {` whose body returns an error Status (and each one-line `if (COND) return Status::...`), the
check is disabled (`if (false && (COND))`), the given test targets are built and run, and the file is restored. A
mutant no test catches ("SURVIVED") marks a check that can be deleted without any test noticing. Hand-written
mutations (arithmetic, orderings) can be given in a file of blocks:

    ## name
    path/to/file.cc
    target_a target_b
    <<<
    exact old text (must occur once)
    ===
    replacement text (may be empty)
    >>>

Usage (from the repository root, with a configured Ninja build):
    scripts/mutation_check.py --build build --file converter/llama2c_reader.cc --targets converter_tests nflash
    scripts/mutation_check.py --build build --mutations my.mut [--only name ...]
    scripts/mutation_check.py --file packer/deployment.cc --targets packer_tests --list   # print, run nothing

Targets that are test executables under BUILD/tests are run after building; others (nflash) are only built, for the
tests that call the binary. The source file is always restored, also on Ctrl-C, and the targets are built again from
it at the end. Takes minutes: one incremental build and one test run per mutant. Do not edit or build in the same
tree meanwhile.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys


def generated(path, targets):
    """One 'disable this check' mutation per error-returning if in `path`."""
    src = open(path).read()
    lines = src.split('\n')
    out = []
    for i, line in enumerate(lines):
        block = re.match(r'^(\s*)if \((.*)\) \{$', line)
        single = re.match(r'^(\s*)if \((.*)\) return Status::\w+\(', line)
        if block and i + 1 < len(lines) and re.search(r'return Status::(?!Ok)', lines[i + 1]):
            old = line + '\n' + lines[i + 1]
            new = f'{block.group(1)}if (false && ({block.group(2)})) {{\n' + lines[i + 1]
        elif single and 'Status::Ok' not in line:
            old = line
            new = line.replace(f'if ({single.group(2)})', f'if (false && ({single.group(2)}))', 1)
        else:
            continue
        if src.count(old) != 1:
            continue  # not unique: cannot be applied unambiguously
        name = os.path.splitext(os.path.basename(path))[0] + f'_L{i + 1}'
        out.append((name, path, targets, old, new))
    return out


def from_file(path):
    text = open(path).read()
    blocks = re.findall(r'^## (\S+)\n(\S+)\n([^\n]+)\n<<<\n(.*?)\n===\n(?:(.*?)\n)??>>>', text, re.S | re.M)
    return [(name, f, targets.split(), old, new or '') for name, f, targets, old, new in blocks]


def run_test(exe, build, timeout):
    """Runs one test executable in a session of its own: on a timeout the whole group goes, with the commands the
    tests started (a mutant that removes a bound can leave an `nflash` child running for hours)."""
    p = subprocess.Popen([exe], cwd=build, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise


def run_one(build, mutation, timeout=600):
    name, path, targets, old, new = mutation
    original = open(path).read()
    if original.count(old) != 1:
        return 'PATTERN NOT FOUND', []
    try:
        with open(path, 'w') as f:
            f.write(original.replace(old, new))
        b = subprocess.run(['ninja', '-C', build] + targets, capture_output=True, text=True)
        if b.returncode != 0:
            return 'BUILD FAILED', [l for l in b.stdout.splitlines() if 'error' in l][:2]
        failed = []
        for t in targets:
            exe = os.path.join(build, 'tests', t)
            if not os.access(exe, os.X_OK):
                continue
            try:
                rc, out = run_test(os.path.abspath(exe), build, timeout)
                if rc != 0:
                    failed += [l for l in out.splitlines() if l.startswith('[  FAILED  ] ') and '(' in l][:2]
                    failed += [] if failed else [f'{t}: exit code {rc}']
            except subprocess.TimeoutExpired:
                failed.append(f'{t}: timed out')
        return ('CAUGHT' if failed else 'SURVIVED'), failed
    finally:
        with open(path, 'w') as f:
            f.write(original)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--build', default='build')
    ap.add_argument('--file', action='append', default=[], help='source file to mutate (its error checks)')
    ap.add_argument('--targets', nargs='+', default=[], help='build targets / test executables for --file')
    ap.add_argument('--mutations', action='append', default=[], help='file of hand-written mutation blocks')
    ap.add_argument('--only', nargs='+', default=[], help='run only these mutation names')
    ap.add_argument('--list', action='store_true', help='print the mutations, run nothing')
    ap.add_argument('--timeout', type=float, default=600,
                    help='seconds a test executable may run before the mutant counts as caught (a hang)')
    a = ap.parse_args()
    if a.file and not a.targets:
        ap.error('--file needs --targets')
    mutations = [m for f in a.file for m in generated(f, a.targets)]
    mutations += [m for f in a.mutations for m in from_file(f)]
    if a.only:
        mutations = [m for m in mutations if m[0] in a.only]
    if not mutations:
        sys.exit('no mutations')
    if a.list:
        for name, path, targets, old, new in mutations:
            print(f'## {name}\n{path}\n{" ".join(targets)}\n<<<\n{old}\n===\n{new}\n>>>')
        return
    if shutil.which('ninja') is None:
        sys.exit('ninja not found')
    survived = 0
    for m in mutations:
        verdict, detail = run_one(a.build, m, a.timeout)
        survived += verdict == 'SURVIVED'
        print(f'{m[0]}: {verdict}', flush=True)
        for d in detail:
            print('    ' + d, flush=True)
    # The sources are restored after each mutant, but the last mutant's binaries would stay in the build tree (and a
    # later test run would test them): build the targets again from the restored sources.
    targets = sorted({t for m in mutations for t in m[2]})
    if subprocess.run(['ninja', '-C', a.build] + targets, capture_output=True).returncode != 0:
        print(f'warning: rebuilding {" ".join(targets)} from the restored sources failed', flush=True)
    print(f'{len(mutations)} mutations, {survived} survived')


if __name__ == '__main__':
    main()
